"""Attack catalogue: misbehaving contributors built on the real node code.

Test tooling only - none of this ships in the node. Three layers:

1. Pure transforms (tensors in, new tensors out; nothing mutated) usable in unit
   tests and benches without any agent: ``sign_flip``, ``scale``,
   ``gaussian_noise``, ``zero_update`` (free rider), ``flip_labels`` (data
   poisoning), ``half_of_chunks``.
2. `Attack` objects that apply them around one assignment's training (some
   keep state: stale replay remembers its first update). ``contribute`` runs the
   real ``gpuflex.node.trainer.train_assignment`` with an attack in the loop -
   what the benches and the unit tests use as "a node".
3. ``agent_class(name)``: a subclass of ``gpuflex.node.agent.NodeAgent`` that
   overrides ``train`` / ``transform_update`` (the contract's hooks), and a CLI:

       python -m tests.tooling.attacks --attack sign_flip <gpuflex-node run args>

Catalogue (``ATTACKS``):

- ``sign_flip``: uploads -delta.
- ``scale``: uploads 10 x delta.
- ``gaussian_noise``: delta + Gaussian noise whose norm is 10 x ||delta||.
- ``label_flip``: trains honestly on poisoned labels y -> C-1-y.
- ``free_rider``: uploads an all-zero delta, claims the shard.
- ``stale_replay``: uploads the first update it ever computed, for every later
  assignment (with a hair of noise so the blob hash differs and the hub's
  duplicate check does not trivially catch it).
- ``colluding``: a pair that returns the same wrong update (-delta, derived
  deterministically from the assignment, so both members agree bit for bit
  without communicating) for a replicated shard.
- ``half_shard``: trains honestly on the first half of its samples and claims
  all of them (sample count and a doubled train_s).

Faults (``FAULTS``, not attacks: they change timing, never an update):

- ``stall``: a device that hangs before training. ``--stall-after N`` trains the
  first N assignments at once; later ones wait ``--stall-s S`` seconds (until
  the node is stopped, without it) and then train honestly. Tests use it to put a
  signal or an outage *inside* an assignment however fast the machine is.
- ``slow``: a device at 1/``--slow-factor`` of this machine's speed (default 2): after
  training honestly it waits (factor - 1) x as long again, inside the training step, so
  the time it reports and the time the hub sees both grow. Benches use it for a node of
  half speed beside full-speed ones without needing a slower machine.
- ``withhold``: trains and uploads honestly but never hands over a checkpoint state the
  hub's referee asks for (node/checkpoints.py): it must be flagged ``unverifiable``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ATTACKS",
    "FAULTS",
    "Attack",
    "agent_class",
    "contribute",
    "flip_labels",
    "gaussian_noise",
    "half_of_chunks",
    "main",
    "make_attack",
    "scale",
    "sign_flip",
    "zero_update",
]


# --------------------------------------------------------------------------- pure transforms


def _map_float(delta: Mapping[str, Tensor], fn: Any) -> dict[str, Tensor]:
    """New dict: fn applied to floating tensors, others copied."""
    return {k: fn(k, t) if t.is_floating_point() else t.clone() for k, t in delta.items()}


def _norm(delta: Mapping[str, Tensor]) -> float:
    return math.sqrt(
        sum(float(t.double().pow(2).sum()) for t in delta.values() if t.is_floating_point())
    )


def sign_flip(delta: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return _map_float(delta, lambda _k, t: -t)


def scale(delta: Mapping[str, Tensor], factor: float = 10.0) -> dict[str, Tensor]:
    return _map_float(delta, lambda _k, t: t * factor)


def gaussian_noise(
    delta: Mapping[str, Tensor], *, relative: float = 10.0, seed: int = 0
) -> dict[str, Tensor]:
    """delta + N(0, s^2) with s chosen so the noise norm is ``relative`` x ||delta||."""
    numel = sum(t.numel() for t in delta.values() if t.is_floating_point())
    std = relative * _norm(delta) / math.sqrt(max(numel, 1))
    gen = torch.Generator().manual_seed(seed)
    return _map_float(
        delta, lambda _k, t: t + torch.randn(t.shape, generator=gen, dtype=t.dtype) * std
    )


def zero_update(delta: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return _map_float(delta, lambda _k, t: torch.zeros_like(t))


def flip_labels(chunk: Mapping[str, Tensor], num_classes: int) -> dict[str, Tensor]:
    """Label-flip poisoning of one classification chunk: y -> C - 1 - y."""
    return {"x": chunk["x"], "y": (num_classes - 1) - chunk["y"]}


def half_of_chunks(chunks: Sequence[Mapping[str, Tensor]]) -> list[Mapping[str, Tensor]]:
    """The first half (rounded up) of the shard's samples: what a lazy node trains on.
    Cuts inside a chunk when needed, so even a one-chunk shard is really halved."""
    total = sum(int(c["x"].shape[0]) for c in chunks)
    left = max(1, math.ceil(total / 2))
    out: list[Mapping[str, Tensor]] = []
    for c in chunks:
        if left <= 0:
            break
        n = int(c["x"].shape[0])
        out.append(c if n <= left else {"x": c["x"][:left], "y": c["y"][:left]})
        left -= n
    return out


# --------------------------------------------------------------------------- attack objects


@dataclasses.dataclass
class Attack:
    """One misbehaviour applied around a real training run.

    ``prepare`` changes the data before training; ``finish`` changes the result
    after it. ``claimed_samples`` is what the shard holds (what a cheat claims).
    """

    name: str
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    def prepare(
        self, chunks: Sequence[Mapping[str, Tensor]], num_classes: int
    ) -> list[Mapping[str, Tensor]]:
        if self.name == "label_flip":
            return [flip_labels(c, num_classes) for c in chunks]
        if self.name == "half_shard":
            return half_of_chunks(chunks)
        return list(chunks)

    def finish(self, result: Any, *, claimed_samples: int, seed: int) -> Any:
        """``result`` is a node TrainResult; returns a new one."""
        delta = result.delta
        rep = dataclasses.replace
        if self.name == "sign_flip":
            return rep(result, delta=sign_flip(delta))
        if self.name == "scale":
            return rep(result, delta=scale(delta, 10.0))
        if self.name == "gaussian_noise":
            return rep(result, delta=gaussian_noise(delta, relative=10.0, seed=seed))
        if self.name == "free_rider":
            return rep(result, delta=zero_update(delta), sample_count=claimed_samples)
        if self.name == "stale_replay":
            first = self.state.setdefault("first", {k: t.clone() for k, t in delta.items()})
            count = self.state["count"] = self.state.get("count", 0) + 1
            if count == 1:
                return result
            # A hair of noise: a byte-identical replay would be refused by the hub's
            # duplicate check already; this one must be caught by verification.
            return rep(result, delta=gaussian_noise(first, relative=1e-6, seed=seed))
        if self.name == "colluding":
            return rep(result, delta=sign_flip(delta))
        if self.name == "half_shard":
            return rep(result, sample_count=claimed_samples, train_s=result.train_s * 2)
        if self.name in ("label_flip", "honest"):
            return result
        raise ValueError(f"unknown attack {self.name!r}")


ATTACKS = (
    "sign_flip",
    "scale",
    "gaussian_noise",
    "label_flip",
    "free_rider",
    "stale_replay",
    "colluding",
    "half_shard",
)


FAULTS = ("stall", "slow", "withhold")


def make_attack(name: str) -> Attack:
    if name not in ATTACKS and name != "honest":
        raise ValueError(f"unknown attack {name!r}; one of {', '.join(ATTACKS)}")
    return Attack(name)


def contribute(
    attack: Attack | None,
    spec: Any,
    global_state: Mapping[str, Tensor],
    chunks: Sequence[Mapping[str, Tensor]],
    cfg: Any,
    seed: int,
    *,
    device: torch.device | None = None,
    on_step: Any = None,
) -> Any:
    """One node's work on one assignment: real training, with ``attack`` (None =
    honest) applied before and after. Returns a node TrainResult. ``on_step``: the trainer's
    step hook (a checkpoint recorder: the commitment is to the training that ran)."""
    from gpuflex.node.trainer import train_assignment

    dev = device if device is not None else torch.device("cpu")
    claimed = sum(int(c["x"].shape[0]) for c in chunks)
    if attack is None:
        return train_assignment(spec, global_state, chunks, cfg, seed, device=dev, on_step=on_step)
    data = attack.prepare(chunks, int(spec.outputs))
    result = train_assignment(spec, global_state, data, cfg, seed, device=dev, on_step=on_step)
    return attack.finish(result, claimed_samples=claimed, seed=seed)


# --------------------------------------------------------------------------- digits scenario


def digits_data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn digits, stratified 80/20 split (random_state=0), x / 16.

    Returns (x_train float32 (n, 64), y_train int64 (n,), x_val, y_val)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)

    def tx(a: Any) -> Tensor:
        return torch.tensor(a / 16.0, dtype=torch.float32)

    def ty(a: Any) -> Tensor:
        return torch.tensor(a, dtype=torch.int64)

    return tx(xtr), ty(ytr), tx(xva), ty(yva)


def digits_spec() -> Any:
    """The digits MLP 64-128-10 (ReLU) of the peers' comparison."""
    from gpuflex.protocol.modelspec import ModelSpec

    return ModelSpec.from_dict(
        {
            "kind": "mlp",
            "input": 64,
            "hidden": [128],
            "outputs": 10,
            "activation": "relu",
            "dropout": 0.0,
            "task": "classification",
        }
    )


def train_config(**overrides: Any) -> Any:
    """The contract's training defaults as used on digits: SGD lr 0.05, momentum 0.9,
    batch 32, 1 local epoch."""
    from gpuflex.protocol.messages import TrainConfig

    base: dict[str, Any] = {
        "local_epochs": 1,
        "batch_size": 32,
        "optimizer": "sgd",
        "lr": 0.05,
        "momentum": 0.9,
        "weight_decay": 0.0,
        "beta1": 0.9,
        "beta2": 0.999,
        "loss": "cross_entropy",
        "grad_clip": 0.0,
    }
    base.update(overrides)
    return TrainConfig(**base)


def make_chunks(
    x: Tensor, y: Tensor, *, chunk_size: int = 64, split: str = "stratified", seed: int = 0
) -> list[dict[str, Tensor]]:
    """Cut (x, y) into chunks. ``stratified``: every class spread evenly over the
    order (each chunk holds all labels, like the hub's split); ``random``: a random
    order; ``sorted``: grouped by label (strongly non-IID shards)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(y.shape[0])
    if split == "random":
        order = torch.randperm(n, generator=gen)
    elif split == "sorted":
        order = torch.argsort(y * n + torch.randperm(n, generator=gen))
    elif split == "stratified":
        keys = torch.empty(n, dtype=torch.float64)
        for label in torch.unique(y):
            idx = torch.nonzero(y == label).flatten()
            idx = idx[torch.randperm(idx.numel(), generator=gen)]
            offset = float(torch.rand((), generator=gen, dtype=torch.float64))
            keys[idx] = (torch.arange(idx.numel(), dtype=torch.float64) + offset) / idx.numel()
        order = torch.argsort(keys, stable=True)
    else:
        raise ValueError(f"split must be stratified, random or sorted, got {split!r}")
    return [
        {
            "x": x[order[s : s + chunk_size]].contiguous(),
            "y": y[order[s : s + chunk_size]].contiguous(),
        }
        for s in range(0, n, chunk_size)
    ]


def initial_state(spec: Any, seed: int = 0) -> dict[str, Tensor]:
    from gpuflex.protocol.modelspec import build_model

    return {k: v.detach().clone() for k, v in build_model(spec, seed).state_dict().items()}


def accuracy(spec: Any, state: Mapping[str, Tensor], x: Tensor, y: Tensor) -> float:
    from gpuflex.protocol.modelspec import build_model

    model = build_model(spec, 0)
    model.load_state_dict(dict(state))
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def apply_delta(state: Mapping[str, Tensor], delta: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {
        k: (v + delta[k]) if k in delta and v.is_floating_point() else v.clone()
        for k, v in state.items()
    }


# --------------------------------------------------------------------------- node agent


def agent_class(name: str) -> type:
    """A ``gpuflex.node.agent.NodeAgent`` subclass that misbehaves as ``name``."""
    from gpuflex.node.agent import NodeAgent

    attack_name = name
    make_attack(attack_name)  # validate early

    class AttackAgent(NodeAgent):  # type: ignore[misc, valid-type]
        """Real node, wrong contributions (see tests/tooling/attacks.py)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.attack = make_attack(attack_name)

        def train(self, assignment: Any, chunks: Any, global_state: Any) -> Any:
            spec_outputs = int(assignment.model_spec.get("outputs", 0) or 0)
            return super().train(
                assignment, self.attack.prepare(chunks, spec_outputs), global_state
            )

        def transform_update(self, assignment: Any, result: Any) -> Any:
            claimed = sum(int(c.samples) for c in assignment.chunks)
            return self.attack.finish(result, claimed_samples=claimed, seed=int(assignment.seed))

    AttackAgent.__name__ = AttackAgent.__qualname__ = (
        "".join(p.title() for p in attack_name.split("_")) + "Agent"
    )
    return AttackAgent


def quant_nudge(wire: Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
    """The attack hidden inside quantization noise: every element of an encoded update moved by
    one step of its encoding, all the same way (int8 codes +1, fp16/bf16 one ulp up, topk values
    by the smallest kept magnitude, sign: one element in 8 set to +scale). Each element stays
    within what rounding could have done; together they push the model in a direction of the
    attacker's choosing."""
    out = dict(wire)
    for name, t in wire.items():
        if kind == "int8" and t.dtype == torch.int8:
            out[name] = (t.to(torch.int16) + 1).clamp(-127, 127).to(torch.int8)
        elif kind in ("fp16", "bf16") and t.dtype in (torch.float16, torch.bfloat16):
            out[name] = torch.nextafter(t, torch.full_like(t, math.inf))
        elif kind == "topk" and name == "topk:value" and t.numel():
            out[name] = t + t.abs().min()
        elif kind == "sign" and t.dtype == torch.uint8 and t.numel():
            out[name] = t | 1  # bit 0 of every byte: element 8i is sent as +scale
    return out


def quant_nudge_agent_class() -> type:
    """A real node that trains honestly and nudges its encoded update (``quant_nudge``)."""
    from gpuflex.node.agent import NodeAgent
    from gpuflex.protocol.encoding import Encoded

    class QuantNudgeAgent(NodeAgent):  # type: ignore[misc, valid-type]
        def encode_update(self, assignment: Any, result: Any, residual: Any) -> Any:
            honest = super().encode_update(assignment, result, residual)
            return Encoded(quant_nudge(honest.wire, assignment.train.update), honest.residual)

    return QuantNudgeAgent


def forged_residual_agent_class(*, after: int = 1, push: float = 1e-3) -> type:
    """A real node that moves its error-feedback residual, from its ``after``-th assignment on,
    by ``push`` on every element (the same way). It trains honestly, commits the moved residual
    in its last checkpoint and encodes with it, so its upload IS the encoding of what it
    committed: the referee's binding check passes, and only the residual's chain (what encoding
    its earlier uploads left, hub/referee.residual_chain) shows the push."""
    from gpuflex.node.agent import NodeAgent

    class ForgedResidualAgent(NodeAgent):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            loads = [0]
            honest_load = self.feedback.load

            def load(job_id: str, shapes: Any) -> Any:
                residual = honest_load(job_id, shapes)
                loads[0] += 1
                if loads[0] <= after:
                    return residual
                base = residual or {k: torch.zeros(v) for k, v in shapes.items()}
                return {k: v + push for k, v in base.items()}

            self.feedback.load = load

    return ForgedResidualAgent


def stall_agent_class(*, after: int, seconds: float | None) -> type:
    """A real node whose assignments after the first ``after`` wait before training.

    The wait checks the node's stop flag, so pause, SIGTERM and shutdown behave as they
    do mid-training; ``seconds=None`` waits until the node is stopped.
    """
    import time

    from gpuflex.node.agent import NodeAgent

    class StallAgent(NodeAgent):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.started = 0

        def train(self, assignment: Any, chunks: Any, global_state: Any) -> Any:
            self.started += 1
            if self.started > after:
                until = math.inf if seconds is None else time.monotonic() + seconds
                while time.monotonic() < until and not self.stop_training.wait(0.05):
                    pass
            return super().train(assignment, chunks, global_state)

    return StallAgent


def slow_agent_class(*, factor: float) -> type:
    """A real node that trains honestly at 1/``factor`` of its machine's speed."""
    import time

    from gpuflex.node.agent import NodeAgent

    class SlowAgent(NodeAgent):  # type: ignore[misc, valid-type]
        def train(self, assignment: Any, chunks: Any, global_state: Any) -> Any:
            t0 = time.monotonic()
            result = super().train(assignment, chunks, global_state)
            until = time.monotonic() + (time.monotonic() - t0) * (factor - 1.0)
            while time.monotonic() < until and not self.stop_training.wait(0.02):
                pass
            if hasattr(result, "train_s"):
                result = dataclasses.replace(result, train_s=result.train_s * factor)
            return result

    return SlowAgent


def withhold_agent_class() -> type:
    """A real node that ignores the referee's state requests (it answers none of them)."""
    from gpuflex.node.agent import NodeAgent

    class WithholdAgent(NodeAgent):  # type: ignore[misc, valid-type]
        async def hand_over(self, asked: Any) -> None:
            self.output.event("state_withheld", request_id=asked.request_id)
            await self.pause_state.sleep(0.5)  # the request stays open: do not spin on it

    return WithholdAgent


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.tooling.attacks --attack NAME <gpuflex-node run args>``."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.tooling.attacks",
        description="Run a real gpuflex node that misbehaves on purpose (test tooling).",
    )
    parser.add_argument("--attack", required=True, choices=ATTACKS + FAULTS)
    parser.add_argument("--stall-after", type=int, default=0, help="stall: assignments trained at once")
    parser.add_argument("--stall-s", type=float, default=None, help="stall: seconds (default: until stopped)")
    parser.add_argument("--slow-factor", type=float, default=2.0, help="slow: 1/speed (2 = half speed)")
    args, rest = parser.parse_known_args(argv)
    if rest and rest[0] == "run":
        rest = rest[1:]
    from gpuflex.node import cli

    if args.attack == "stall":
        cls = stall_agent_class(after=args.stall_after, seconds=args.stall_s)
    elif args.attack == "slow":
        cls = slow_agent_class(factor=max(1.0, args.slow_factor))
    elif args.attack == "withhold":
        cls = withhold_agent_class()
    else:
        cls = agent_class(args.attack)
    return int(cli.main(["run", *rest], agent_cls=cls))


if __name__ == "__main__":
    sys.exit(main())
