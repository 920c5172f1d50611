"""LoRA with int8 frozen weights against a full fine-tune of the same model, in one run.

A small decoder-only transformer is first trained in full on task A (``--pretrain`` steps: a
random first-order Markov chain over ``--vocab`` tokens); that state is the base. Both fine-tunes
then start from it on task B (another chain, half of A's rows kept) and run the same federated
rounds: every round two shards of B train through the node's own trainer
(node/trainer.train_assignment, Adam, ``--local-steps`` steps each), the hub's FedAvg
(hub/policy/aggregation.fedavg) averages the two updates and the server optimizer
(hub/policy/server_optimizer) applies the mean to the model, as the hub does.

- ``figures.lora_int8_memory_vs_full_finetune``: training-state bytes of a LoRA node over a full
  fine-tune's, measured on the trainer's own tensors after the first step: the model's whole
  state (LoRA: int8 weights, their scales, the frozen fp32 tensors such as embeddings and
  LayerNorms, the adapters), every gradient that exists and the optimizer's state.
- ``figures.lora_update_bytes_vs_full``: the bytes of one update on the wire (GFT1, fp32
  encoding) of LoRA over a full fine-tune.
- ``figures.val_loss``: task B's validation loss of the base, after the LoRA fine-tune and after
  the full fine-tune (next-token cross-entropy), with the merged LoRA model's beside it and the
  floor (task B's own chain's).

Usage: python bench/lora.py [--rounds 8] [--local-steps 20] [--rank 4] [--out bench/results/lora.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("attn", "mlp")


def _chain(vocab: int, seed: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """A transition matrix (vocab, vocab): each row a peaked distribution; ``keep``'s rows kept."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    p = torch.softmax(logits, dim=1)
    if keep is not None:
        half = torch.arange(vocab) % 2 == 0
        p[half] = keep[half]
    return p


def _sequences(p: torch.Tensor, n: int, context: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` token sequences of ``context + 1`` drawn from chain ``p``, as (x, y) next-token pairs."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, context + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, p.shape[0], (n,), generator=g)
    for t in range(context):
        tokens[:, t + 1] = torch.multinomial(p[tokens[:, t]], 1, generator=g).squeeze(1)
    return {"x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}


def _spec_text(args: argparse.Namespace, lora: bool) -> str:
    train = (
        (
            f'finetune = "lora"\nlora_rank = {args.rank}\nlora_alpha = {2 * args.rank}\n'
            f'lora_targets = {json.dumps(list(TARGETS))}\nfrozen_precision = "int8"\n'
        )
        if lora
        else ""
    )
    return (
        f'[job]\nname = "bench-lora"\n[model]\nkind = "transformer"\nvocab = {args.vocab}\n'
        f"context = {args.context}\nlayers = {args.layers}\nwidth = {args.width}\nheads = 4\n"
        f'[train]\noptimizer = "adam"\nlr = {args.lr_lora if lora else args.lr}\nbatch_size = 32\n'
        f"local_steps = {args.local_steps}\n{train}"
    )


def _val_loss(
    spec: Any, state: Mapping[str, torch.Tensor], val: Mapping[str, torch.Tensor]
) -> float:
    from gpuflex.protocol.modelspec import build_for_state
    from gpuflex.protocol.transformer import NextTokenLoss

    with torch.no_grad():
        model = build_for_state(spec, state, share=True).eval()
        return float(NextTokenLoss()(model(val["x"]), val["y"]))


def _chain_loss(p: torch.Tensor, val: Mapping[str, torch.Tensor]) -> float:
    """Cross-entropy of the chain that drew ``val`` on it."""
    return float(-torch.log(p[val["x"], val["y"]]).mean())


def _state_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """Bytes of the model's state, its gradients and the optimizer's state (the trainer's tensors)."""
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    held += sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )
    held += sum(t.numel() * t.element_size() for ts in optimizer.state_slots().values() for t in ts)
    return int(held)


def _pretrain(args: argparse.Namespace, task_a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from gpuflex.node.trainer import train_assignment
    from gpuflex.protocol.jobspec import parse_job_spec
    from gpuflex.protocol.modelspec import build_model

    job = parse_job_spec(_spec_text(args, lora=False))
    state = build_model(job.model, seed=0).state_dict()
    cfg = dataclasses.replace(job.train.train_config(), local_steps=args.pretrain, lr=3e-3)
    res = train_assignment(job.model, state, [task_a], cfg, 1, device=torch.device("cpu"))
    return {k: v + res.delta[k] for k, v in state.items()}


def _finetune(
    args: argparse.Namespace,
    base: Mapping[str, torch.Tensor],
    lora: bool,
    shards: list[dict[str, torch.Tensor]],
    val: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """Federated rounds of two shards each; the job's figures."""
    from gpuflex.hub.policy.aggregation import fedavg
    from gpuflex.hub.policy.server_optimizer import ServerOptimizer
    from gpuflex.node.trainer import train_assignment
    from gpuflex.protocol.jobspec import parse_job_spec
    from gpuflex.protocol.lora import lora_state, merged_model
    from gpuflex.protocol.tensors import encode_state

    job = parse_job_spec(_spec_text(args, lora))
    spec, cfg = job.model, job.train.train_config()
    # the base's weights; a LoRA job's quantized, beside adapters keyed by the job's seed
    state = lora_state(spec, base) if lora else {k: v.detach().clone() for k, v in base.items()}
    server = ServerOptimizer()
    held: list[int] = []

    def measure(step: int, model: torch.nn.Module, optimizer: Any, _scaler: Any) -> None:
        if step == 1 and not held:  # after the first step every gradient and moment exists
            held.append(_state_bytes(model, optimizer))

    update_bytes = 0
    started = time.perf_counter()
    for rnd in range(args.rounds):
        deltas = []
        for i, shard in enumerate(shards):
            res = train_assignment(
                spec,
                state,
                [shard],
                cfg,
                100 * rnd + i,
                device=torch.device("cpu"),
                on_step=measure,
            )
            deltas.append(res.delta)
            update_bytes = len(encode_state(res.delta))
        state = server.step(state, fedavg(deltas, [1.0] * len(deltas)))
    out = {
        "val_loss": _val_loss(spec, state, val),
        "held_bytes": held[0],
        "update_bytes": update_bytes,
        "train_s": round(time.perf_counter() - started, 2),
        "params": sum(t.numel() for t in state.values()),
    }
    if lora:
        plain_spec, merged = merged_model(spec, state)
        out["val_loss_merged"] = _val_loss(plain_spec, merged, val)
        out["trained_params"] = sum(
            v.numel() for k, v in state.items() if k.endswith((".lora_a", ".lora_b"))
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from gpuflex.protocol.jobspec import parse_job_spec

    torch.set_num_threads(1)
    task_a = _chain(args.vocab, seed=1)
    task_b = _chain(args.vocab, seed=2, keep=task_a)
    base = _pretrain(args, _sequences(task_a, 2048, args.context, seed=3))
    shards = [_sequences(task_b, 512, args.context, seed=10 + i) for i in range(2)]
    val = _sequences(task_b, 512, args.context, seed=20)
    plain = parse_job_spec(_spec_text(args, lora=False)).model
    lora = _finetune(args, base, True, shards, val)
    full = _finetune(args, base, False, shards, val)
    figures = {
        "lora_int8_memory_vs_full_finetune": round(lora["held_bytes"] / full["held_bytes"], 4),
        "lora_update_bytes_vs_full": round(lora["update_bytes"] / full["update_bytes"], 4),
        "val_loss": {
            "base": round(_val_loss(plain, base, val), 4),
            "lora_int8": round(lora["val_loss"], 4),
            "lora_int8_merged": round(lora["val_loss_merged"], 4),
            "full_finetune": round(full["val_loss"], 4),
            # the chain's own next-token probabilities: the floor no model goes under
            "task_b_chain": round(_chain_loss(task_b, val), 4),
        },
    }
    return {
        "bench": "lora",
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"targets": list(TARGETS)},
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}, "
        f"python {platform.python_version()}, torch {torch.__version__}",
        "figures": figures,
        "runs": {"lora_int8": lora, "full_finetune": full},
        "bounds": {"lora_int8_memory_vs_full_finetune": 0.35, "lora_update_bytes_vs_full": 0.05},
    }


def _table(result: dict[str, Any]) -> str:
    lo, fu = result["runs"]["lora_int8"], result["runs"]["full_finetune"]
    v = result["figures"]["val_loss"]
    rows = [
        ("", "LoRA int8", "full fine-tune", "ratio"),
        (
            "training state, bytes",
            f"{lo['held_bytes']:,}",
            f"{fu['held_bytes']:,}",
            f"{result['figures']['lora_int8_memory_vs_full_finetune']:.3f} (<= 0.35)",
        ),
        (
            "update on the wire, bytes",
            f"{lo['update_bytes']:,}",
            f"{fu['update_bytes']:,}",
            f"{result['figures']['lora_update_bytes_vs_full']:.3f} (<= 0.05)",
        ),
        ("trained parameters", f"{lo['trained_params']:,}", f"{fu['params']:,}", ""),
        (
            f"val loss (base {v['base']:.3f}, floor {v['task_b_chain']:.3f})",
            f"{v['lora_int8']:.3f} (merged {v['lora_int8_merged']:.3f})",
            f"{v['full_finetune']:.3f}",
            "",
        ),
        ("train time, s", f"{lo['train_s']}", f"{fu['train_s']}", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    os.nice(10)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--pretrain", type=int, default=300)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--local-steps", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-lora", type=float, default=1e-2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora.json"))
    args = p.parse_args(argv)
    result = run(args)
    print(_table(result))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = all(result["figures"][k] <= bound for k, bound in result["bounds"].items())
    print(f"wrote {args.out}; {'within' if ok else 'OUTSIDE'} the bounds")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
