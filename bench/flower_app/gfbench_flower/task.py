"""Model, data and training shared by the ServerApp and the ClientApp.

Data comes pre-split from bench/vs_flower.py as .npz files (no pickle): the
same train/test split and the same 8 IID shards that the GPUFlex side uses.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch import nn


def build_model(input_dim: int, hidden: list[int], num_classes: int, seed: int) -> nn.Module:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = input_dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    model = nn.Sequential(*layers)
    torch.random.set_rng_state(gen_state)
    return model


def parse_hidden(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(",", " ").split()]


def load_npz(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(path, allow_pickle=False) as z:
        return torch.from_numpy(z["x"]).float(), torch.from_numpy(z["y"]).long()


def train_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    seed: int,
) -> tuple[float, float, int]:
    """Plain SGD; returns (mean loss of the last epoch, seconds, steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    t0 = time.perf_counter()
    steps = 0
    last = 0.0
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(seed + epoch)
        perm = torch.randperm(len(x), generator=g)
        total = 0.0
        for i in range(0, len(x), batch_size):
            idx = perm[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            steps += 1
        last = total / max(1, len(x))
    return last, time.perf_counter() - t0, steps


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())
