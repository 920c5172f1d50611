"""Heterogeneity: honest nodes in numerically different compute classes, attackers in every class.

Issue 14's bench. It drives the hub's own round policy, never a copy of it: bench/robustness.py's
``Simulation`` (``policy.decide_shard`` each time a shard's group changes, ``policy.judge_round``
when the round closes, ``aggregate`` and ``ServerOptimizer``, in the order RoundEngine calls them;
real training with the node's own ``gpuflex.node.trainer.train_assignment``), with:

- a compute class per node, four CPU classes (fp32 with 1 thread and oneDNN on; fp32 with 2
  intra-op threads; fp32 with oneDNN off; bf16 autocast). Measured here (``max_distance`` of the
  mixed runs): all four differ on the CNN; fp32 and fp32 without oneDNN train bit-identically on
  the MLP and the sequence model, so those jobs have three numerically different classes. Each
  node's training runs inside its class (``torch.set_num_threads``, ``torch.backends.mkldnn``,
  ``[train] precision``), and its class key is the product's own
  (``gpuflex.node.device.compute_class`` read inside the class, ``gpuflex.protocol.compute.class_key``).
  The policy gets the members' class keys and the comparison the engine would pass
  (``policy.comparison_of``; ShardSettling.replica_state), so a cross-class group is judged as the
  hub judges it (``judge_cross_class``, and the referee's segment re-execution where the round
  policy asks for it).
- replicas placed regardless of class (the policy's ``replica_candidates`` only): the hub's
  scheduler prefers a same-class node for half of ``replica_wait_s``; this bench is the case where
  none is online, so that cross-class verification is what is measured.
- the attack catalogue (tests/tooling/attacks.py, as bench/robustness.py runs it): one run per
  attack with 20 % of the nodes attacking, one attacker in every class;
- a coordinated adversary holding 30 % of the identities, spread over the classes: every identity
  sends the same crafted update for a shard (computed once, by whichever of them trains the shard
  first), built to stay under the thresholds it can see: the honest update with its output layer's
  sign flipped, scaled by ``COLLUDE_SCALE`` (under ``norm_bound`` x the round's median). Three
  strategies, one run each: ``coordinated`` crafts from its first update on;
  ``coordinated_patient`` trains honestly until an identity is trusted (it sees that from how
  rarely its work is replicated) and crafts from then on, when it is replicated least;
  ``coordinated_adaptive`` is patient and also stays over the trend audit's threshold: it bends
  its inverted layer towards the model's trend (which it computes from the models it is sent, as
  the hub does) until that layer's cosine to it is ``ADAPTIVE_COSINE``;
- baselines measured in the same run: plain fp32 federated training (one class, no replication,
  no referee, every shard trained once) for accuracy and cost, and a clean run of each class alone
  (with verification) for the per-class accuracy.

Figures (``figures``):
- ``cross_class_pairs``: honest replica pairs of different class keys that the policy compared;
  ``cross_class_beyond_strict``: of those, how many were further apart than the strict
  ``tolerance`` (what the strict comparison alone would have flagged);
- ``honest_flagged``: flags that stand on honest nodes' updates, over every run;
- ``detection_rate``: malicious updates flagged or left out of the aggregate / submitted, overall
  and per attack and class (``detection_by_attack_class``);
- ``replication_overhead_steady``: extra trainings / shards once every honest node is trusted;
- ``verification_cost_fraction``: CPU the hub spends verifying (decide_shard, judge_round, and the
  referee's segment re-execution, ``judge_segment``; ``time.thread_time`` of those calls) over the
  CPU of all trainings (every node's, replicas included: ``time.process_time`` per step of the
  trainings run here, checkpoint commitments included, times the steps every node trained);
  decide_shard's CPU includes the members' fingerprints (hub/policy/fingerprints.py), taken the
  first time a group of two or more committed members that are not all the same bytes is decided,
  and kept while the shard is open, as the hub's ShardSettling keeps them; each record carries
  the sha of its blob, as the hub's do. ``verification_cost_fraction_full_distances`` (and the ``_full_audit``
  figures' ``_full_distances`` twins): the same with decide_shard measuring every replica pair in
  full, as the hub did before fingerprints: every decide_shard call is made a second time, on the
  same inputs, with ``compare_replicas(use_fingerprints=False)`` and no fingerprints taken, timed
  apart; ``fingerprint_decisions_differ`` counts the calls whose two decisions differ (the
  decision, its statuses and its flags with their evidence; 0 is the contract), and
  ``replica_pairs_by_measure`` how compare_replicas read the pairs it was asked about ("bytes":
  equal shas or digests, "fingerprint": settled apart by the bound, "full": measured, "memo": a
  full measure read again within one decide_shard call);
  ``verification_cost_fraction_steps``: the referee's re-executed steps / trained steps;
  ``referee_checks_by_reason``: the referee's re-executions by why (disagreement, spot_check,
  against_trend: an update with a layer against the model's trend, hub/policy/round_policy.py rule 4) and
  whether the update was honest; ``trend_audit_honest_rate``: honest ``against_trend``
  re-executions per training;
- ``accuracy_gap_points``: per job and class, the class's final accuracy minus plain fp32's;
- ``colluder_inclusion_rate``: the coordinated adversary's crafted updates that reached the
  aggregate / crafted updates submitted (the worst strategy; each in ``colluder_inclusion``), at
  the job spec's defaults, and ``colluder_accuracy_drop_points``: what each strategy's run lost
  against the clean mixed run; ``colluder_inclusion_rate_full_audit``: the adaptive strategy
  (the strongest) again with ``spot_check_trusted = 1`` (every update a trusted node sends is
  re-executed on one segment before it counts), with its ``verification_cost_fraction_full_audit``
  and ``referee_steps_fraction_full_audit`` beside ``verification_cost_fraction_patient_default``
  (the patient adversary at the defaults): the price of the strictest setting;
  ``verification_cost_fraction_full_audit_every1`` and ``node_commit_cost_every1_vs_default``: the
  same full audit on one-step segments (``checkpoint_every = 1``), the cheapest re-execution a
  commitment allows, and what committing every step costs the nodes' training.

The referee re-executes a segment as the hub does (``gpuflex.hub.policy.referee.replay_onednn`` of the
node's compute class: a CPU node's own oneDNN setting).

Run (2 cores, about 10 min): .venv/bin/python bench/heterogeneity.py [--rounds 30] [--epochs 5]
An AVX-512 host can run as an AVX2 one (the kernels that exposed an honest fp32 node without oneDNN
before the referee replayed in its class): ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 in the
environment (recorded in ``machine.isa_caps``).
    [--jobs mlp,cnn,seq] [--classes fp32,fp32-t2,fp32-nodnn,bf16] [--attacks ...] [--out PATH]
-> bench/results/heterogeneity.json, and a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The 2-thread class on a busy 2-core machine: OpenMP's spinning workers made a 0.2 s CNN training
# take up to 2.4 s (measured beside other work); passive waiting keeps it at 0.15-0.25 s. It
# changes no result (the same kernels, the same split), only the waiting. Before torch starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.tooling
sys.path.insert(0, str(ROOT / "bench"))  # robustness

import robustness as rb  # noqa: E402
from gpuflex.hub.policy import round_policy as policy  # noqa: E402
from gpuflex.hub.policy import verification as vf  # noqa: E402
from gpuflex.hub.policy.fingerprints import fingerprint_of  # noqa: E402
from gpuflex.hub.policy.referee import STANDOUT  # noqa: E402
from gpuflex.hub.policy.replica_comparison import needs_no_fingerprint  # noqa: E402
from gpuflex.node.device import compute_class  # noqa: E402
from gpuflex.protocol.checkpoint import checkpoint_steps, model_part, segment_norm, state_hash  # noqa: E402
from gpuflex.protocol.compute import class_key  # noqa: E402
from gpuflex.protocol.jobspec import VerificationSpec  # noqa: E402
from gpuflex.protocol.messages import ComputeClass  # noqa: E402
from gpuflex.protocol.modelspec import ModelSpec  # noqa: E402
from gpuflex.protocol.tensors import encode_state  # noqa: E402

from tests.tooling import attacks as atk  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "heterogeneity.json"

#: class name -> (precision, intra-op threads, oneDNN). Each pair differs numerically on this CPU for
#: at least one job (oneDNN on/off only on the CNN; bench/class_distance.py, and max_distance here).
CLASSES: dict[str, tuple[str, int, bool]] = {
    "fp32": ("fp32", 1, True),
    "fp32-t2": ("fp32", 2, True),
    "fp32-nodnn": ("fp32", 1, False),
    "bf16": ("bf16", 1, True),
}
JOBS = ("mlp", "cnn", "seq")
N_NODES = 20
ATTACK_FRACTION = 0.2
COORDINATED_FRACTION = 0.3
COORDINATED = "coordinated"  # crafts from its first update on
PATIENT = "coordinated_patient"  # trains honestly until the identity is trusted, then crafts
#: patient, and it knows the hub's trend audit: it bends its inverted layer towards the model's trend
#: (which every node can compute from the models it is sent) until that layer's cosine to it is
#: ADAPTIVE_COSINE, just over trend_cosine_min, so the trend never picks it
ADAPTIVE = "coordinated_adaptive"
ADAPTIVE_COSINE = 0.05
#: adaptive, and it forges its checkpoint commitment so that the update binds: honest states up to
#: the last checkpoint, then the round's model plus its crafted update as the last state, every
#: hash recomputed, every segment norm claimed truthfully (the referee tests every one it holds the
#: states of). It scales its change to the honest update down until its last segment no longer
#: stands out (referee.STANDOUT: a standout segment is the one replayed), so only a replay of its
#: last segment drawn by the referee tells; where the change sits does not matter to a uniform
#: draw (referee.pick_segment). (Claiming an honest-looking norm for the crafted segment instead
#: lets a bigger change in when its update is not audited, and is caught whenever it is.)
FORGER = "coordinated_forger"
ADVERSARIES = (COORDINATED, PATIENT, ADAPTIVE, FORGER)
WAITS_FOR_TRUST = (PATIENT, ADAPTIVE, FORGER)
#: the adaptive adversary's run with ``spot_check_trusted = 1`` (every trusted update re-executed on one
#: segment before it counts): what the job's strictest setting buys, and what it costs
FULL_AUDIT = "adaptive_full_audit"
#: the same on the finest checkpoint grid (``checkpoint_every = 1``: a segment is one step), the
#: cheapest re-execution a commitment allows: what the audit then costs the hub, and the node
FULL_AUDIT_FINE = "adaptive_full_audit_every1"
#: the forger with every trusted update re-executed on one segment
FORGER_FULL_AUDIT = "forger_full_audit"
AUDIT_RUNS = (FULL_AUDIT, FULL_AUDIT_FINE, FORGER_FULL_AUDIT)
#: the crafted update's scale: under the default norm_bound (2.5 x the round's median norm per sample)
COLLUDE_SCALE = 2.2
VSPEC = VerificationSpec()  # the job spec's defaults, as the hub runs them
#: environment variables that cap the instruction set torch's kernels use (oneDNN's, ATen's own)
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


# --------------------------------------------------------------------------- compute classes


@contextlib.contextmanager
def numeric_class(name: str) -> Iterator[tuple[str, int, bool]]:
    """Run the body in class ``name``: its thread count and oneDNN setting (restored after)."""
    precision, threads, onednn = CLASSES[name]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():  # torch warns of Intel-GPU TF32 on every mkldnn.flags()
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
            flags = torch.backends.mkldnn.flags(enabled=onednn)
            flags.__enter__()
        try:
            yield precision, threads, onednn
        finally:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
                flags.__exit__(None, None, None)
    finally:
        torch.set_num_threads(before)


def compute_of_class(name: str) -> ComputeClass:
    """The ComputeClass a node in class ``name`` says in its hello (read inside the class)."""
    with numeric_class(name):
        return compute_class(torch.device("cpu"))


def key_of(name: str) -> str:
    """The product's class key of a node in class ``name`` (its hello's ComputeClass and the
    precision it trains the job in)."""
    return class_key(compute_of_class(name), CLASSES[name][0])


# --------------------------------------------------------------------------- the jobs


def make_world(job: str, *, epochs: int, chunks: int) -> dict[str, Any]:
    """robustness.make_world's keys (spec, cfg, chunks, xva, yva, state0) for one of JOBS.

    ``chunks``: 64-sample chunks of training data (the hub's stratified split); a round cuts them
    into shards of robustness.CHUNKS_PER_SHARD."""
    cfg = atk.train_config(local_epochs=epochs)
    if job in ("mlp", "cnn"):
        xtr, ytr, xva, yva = atk.digits_data()
        if job == "mlp":
            spec = atk.digits_spec()
        else:
            spec = ModelSpec.from_dict({"kind": "cnn", "image": [1, 8, 8], "channels": [8, 16], "kernel": 3,
                                        "pool": "max", "hidden": [32], "outputs": 10})
            xtr, xva = xtr.reshape(-1, 1, 8, 8), xva.reshape(-1, 1, 8, 8)
    elif job == "seq":
        # An Embedding and a LayerNorm on generated token sequences: the label is which of three
        # token groups occurs most often in the sequence (every position counts).
        vocab, seq, classes = 48, 8, 3
        spec = ModelSpec.from_dict({"kind": "sequential", "input_shape": [seq], "outputs": classes, "layers": [
            {"type": "Embedding", "num_embeddings": vocab, "embedding_dim": 16},
            {"type": "LayerNorm", "normalized_shape": [16]},
            {"type": "Flatten"},
            {"type": "Linear", "in_features": seq * 16, "out_features": 32},
            {"type": "ReLU"},
            {"type": "Linear", "in_features": 32, "out_features": classes}]})
        gen = torch.Generator().manual_seed(14)
        x = torch.randint(0, vocab, (64 * chunks + 400, seq), generator=gen)
        counts = torch.stack([((x % classes) == c).sum(1) for c in range(classes)], 1)
        y = (counts * 4 + torch.arange(classes)).argmax(1)  # ties: the lowest group wins
        xtr, ytr, xva, yva = x[: 64 * chunks], y[: 64 * chunks], x[64 * chunks :], y[64 * chunks :]
    else:
        raise ValueError(f"unknown job {job!r}; one of {', '.join(JOBS)}")
    all_chunks = atk.make_chunks(xtr, ytr, split="stratified")
    return {"spec": spec, "cfg": cfg, "chunks": all_chunks[:chunks], "xva": xva, "yva": yva,
            "state0": atk.initial_state(spec)}


# --------------------------------------------------------------------------- the coordinated adversary


def output_layer(delta: dict[str, torch.Tensor]) -> list[str]:
    """The last layer's floating tensors (its weight and bias): the keys of the last module."""
    keys = [k for k, t in delta.items() if t.is_floating_point()]
    last = keys[-1].rsplit(".", 1)[0]
    return [k for k in keys if k.rsplit(".", 1)[0] == last]


def craft(delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adversary's update: the output layer's delta sign-flipped, everything x COLLUDE_SCALE.
    Its norm is COLLUDE_SCALE x the honest one: under the default norm bound (2.5 x median)."""
    flip = set(output_layer(delta))
    return {k: (-t if k in flip else t) * COLLUDE_SCALE if t.is_floating_point() else t.clone()
            for k, t in delta.items()}


def bend_towards(v: torch.Tensor, t: torch.Tensor, cosine: float) -> torch.Tensor:
    """``v`` plus the least multiple of ``t``'s direction that brings cos(v, t) up to ``cosine``
    (``v`` itself when it is there already); found by bisection, float64."""
    v64, t64 = v.double().reshape(-1), t.double().reshape(-1)
    tn = t64 / t64.norm().clamp_min(1e-30)
    vn = float(v64.norm())

    def cos(mu: float) -> float:
        w = v64 + mu * tn
        return float(w @ tn / w.norm().clamp_min(1e-30))

    if vn == 0.0 or cos(0.0) >= cosine:
        return v.clone()
    lo, hi = 0.0, vn
    while cos(hi) < cosine:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cos(mid) < cosine else (lo, mid)
    return (v64 + hi * tn).to(v.dtype).reshape(v.shape)


def craft_adaptive(delta: dict[str, torch.Tensor], trend: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """craft(), with the inverted output layer bent towards the trend until its cosine to it is
    ADAPTIVE_COSINE (weight and bias together, as verification.trend_alignment measures a layer)."""
    out = craft(delta)
    if trend is None:
        return out
    keys = output_layer(delta)
    flat = torch.cat([out[k].reshape(-1) for k in keys])
    bent = bend_towards(flat, torch.cat([trend[k].reshape(-1) for k in keys]), ADAPTIVE_COSINE)
    at = 0
    for k in keys:
        n = out[k].numel()
        out[k] = bent[at : at + n].reshape(out[k].shape).to(out[k].dtype)
        at += n
    return out


class Coordinated(atk.Attack):
    """One identity of the coordinated adversary. Every identity shares ``crafted``: a shard's
    crafted update is made once (from the first identity's honest training) and sent by every
    identity that gets the shard, so colluding replicas agree bit for bit. ``trend``: the model's
    trend as the hub measures it this round (set by the simulation; the adaptive strategy reads it)."""

    def __init__(self, crafted: dict[int, Any], name: str = COORDINATED) -> None:
        super().__init__(name)
        self.crafted = crafted
        self.trend: dict[str, torch.Tensor] | None = None

    def finish(self, result: Any, *, claimed_samples: int, seed: int) -> Any:
        if seed not in self.crafted:  # the shard issue's seed names it
            self.crafted[seed] = craft_adaptive(result.delta, self.trend) if self.name in (ADAPTIVE, FORGER) \
                else craft(result.delta)
        return dataclasses.replace(result, delta=self.crafted[seed])


def forge(w: rb.Work, global_state: dict[str, torch.Tensor]) -> rb.Work:
    """The forger's work: its commitment made consistent with its crafted update (see FORGER).
    The last state's model is the round's model plus the crafted update, and the uploaded update
    is that state minus the round's model (float rounding included), so the binding check holds."""
    c = w.commitment
    assert c is not None
    grid = checkpoint_steps(c.steps, c.every)
    before = c.norms[:-1]
    cap = STANDOUT * statistics.median(before) * 0.999 if len(before) >= 2 else math.inf
    prev, honest = model_part(w.states[grid[-2]]), model_part(w.states[grid[-1]])
    floats = [k for k, g in global_state.items() if g.is_floating_point()]
    change = {k: w.rec.delta[k].to(g.dtype) - (honest[k] - g) for k, g in global_state.items() if k in floats}

    def at(scale: float) -> dict[str, torch.Tensor]:  # its last state's model with the change scaled
        return {k: (honest[k] + scale * change[k]) if k in change else honest[k] for k in honest}

    lo, hi = 0.0, 1.0
    if segment_norm(prev, at(1.0)) > cap:
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if segment_norm(prev, at(mid)) <= cap else (lo, mid)
        hi = lo
    model = at(hi)
    last = {**w.states[grid[-1]], **{f"model.{k}": v for k, v in model.items()}}
    delta = {k: (model[k] - g) if k in change else model[k].clone() for k, g in global_state.items()}
    claim = segment_norm(prev, model)
    forged = dataclasses.replace(c, hashes=(*c.hashes[:-1], state_hash(last)), norms=(*before, claim))
    return dataclasses.replace(w, rec=dataclasses.replace(w.rec, delta=delta,
                                                           path_length=math.fsum(forged.norms)),
                               sha=hashlib.sha256(encode_state(delta)).hexdigest(), commitment=forged,
                               states={**w.states, grid[-1]: last})


# --------------------------------------------------------------------------- the simulation


@dataclass
class Meter:
    """CPU seconds of the calls it wraps, by name."""

    cpu: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    #: decide_shard's CPU on the path that measures every replica pair in full (not in ``cpu``)
    full_cpu: float = 0.0
    #: the calling thread's CPU: the wrapped calls run on it (1 intra-op thread outside a node's
    #: class), and process_time would also count the checkpoint writer threads of the trainings
    clock: Callable[[], float] = time.thread_time

    @contextlib.contextmanager
    def wrap(self, owner: Any, name: str, observe: Callable[[Any], None] | None = None) -> Iterator[None]:
        """Time every call of ``owner.name`` (a module attribute the simulation looks up at call
        time) while the body runs, and hand each result to ``observe``; the function itself is
        untouched."""
        original: Callable[..., Any] | None = getattr(owner, name, None)
        if original is None:
            yield
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self.clock()
            try:
                result = original(*args, **kwargs)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + self.clock() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
            if observe is not None:
                observe(result)
            return result

        setattr(owner, name, timed)
        try:
            yield
        finally:
            setattr(owner, name, original)


@contextlib.contextmanager
def _full_distances() -> Iterator[None]:
    """The round policy as it ran before fingerprints: every replica pair measured in full
    (compare_replicas' own switch) and no fingerprint taken (``fingerprinted`` passes the records
    through)."""
    compare, fingerprinted = policy.compare_replicas, policy.fingerprinted
    policy.compare_replicas = functools.partial(compare, use_fingerprints=False)  # type: ignore[assignment]
    policy.fingerprinted = lambda records, *_: list(records)  # type: ignore[assignment]
    try:
        yield
    finally:
        policy.compare_replicas, policy.fingerprinted = compare, fingerprinted


@contextlib.contextmanager
def _counting_pairs(counts: dict[str, int]) -> Iterator[None]:
    """Count how compare_replicas read each pair (``ReplicaPair.measured``) while the body runs."""
    compare = policy.compare_replicas

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = compare(*args, **kwargs)
        for p in out.pairs:
            counts[p.measured] = counts.get(p.measured, 0) + 1
        return out

    policy.compare_replicas = counted  # type: ignore[assignment]
    try:
        yield
    finally:
        policy.compare_replicas = compare


def _decided(d: Any) -> tuple[Any, ...]:
    """What a shard decision decides (its evidence aside: a pair read from fingerprints says so
    there): its kind, the updates and statuses it names, and its flags with their evidence."""
    fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "evidence"}
    return type(d).__name__, json.dumps(fields, sort_keys=True, default=repr)


class HeteroSimulation(rb.Simulation):
    """robustness.Simulation with a compute class per node and the class keys in the policy's input.

    Nodes n00.. get classes round-robin; the attackers are the last ids, so with 4 classes and 20 %
    of 20 nodes there is one attacker in every class."""

    def __init__(self, world: dict[str, Any], attack: str | None, n_attackers: int, rounds: int, *,
                 classes: Sequence[str], n_nodes: int = N_NODES, seed: int = 0,
                 vspec: VerificationSpec = VSPEC, **kw: Any) -> None:
        super().__init__(world, None, 0, rounds, seed=seed, vspec=vspec, **kw)
        ids = [f"n{i:02d}" for i in range(n_nodes)]
        bad = set(ids[n_nodes - n_attackers:]) if attack else set()
        crafted: dict[int, Any] = {}

        def attack_of(nid: str) -> atk.Attack | None:
            if nid not in bad:
                return None
            return Coordinated(crafted, attack) if attack in ADVERSARIES else atk.make_attack(str(attack))

        self.nodes = {n: rb.Node(n, attack_of(n)) for n in ids}
        self.klass = {nid: classes[i % len(classes)] for i, nid in enumerate(ids)}
        self.keys = {name: key_of(name) for name in set(classes)}
        self.computes = {name: compute_of_class(name) for name in set(classes)}
        self.worlds = {name: dict(self.w, cfg=dataclasses.replace(self.w["cfg"], precision=CLASSES[name][0]))
                       for name in set(classes)}
        self.meter = Meter()
        self.h: dict[str, Any] = {
            "cross_class_pairs": 0, "cross_class_beyond_strict": 0, "cross_class_bitwise_equal": 0,
            "cross_class_flagged": 0, "max_distance": {}, "train_cpu_s": 0.0, "fresh_steps": 0,
            "steps": 0, "malicious": {}, "honest_flags": {}, "differ": 0, "pairs": {},
        }
        #: update id -> (its record, the record with its fingerprint), kept as the hub's ShardSettling
        #: keeps the fingerprints
        self.fingerprints: dict[str, tuple[Any, Any]] = {}

    def _observe(self, decision: Any) -> None:
        """Flags on honest nodes' updates, by reason (what honest_flagged counts, explained);
        a replica_mismatch flag the round withdraws is dropped, as the hub does."""
        for f in getattr(decision, "flags", ()):
            if self.nodes[f.node_id].attack is None:
                self.h["honest_flags"][(f.update_id, f.reason)] = self.klass[f.node_id]
        for uid in getattr(decision, "withdrawn", ()):
            self.h["honest_flags"].pop((uid, "replica_mismatch"), None)

    def compute_of(self, node_id: str) -> ComputeClass:
        return self.computes[self.klass[node_id]]

    def replica_state(self, wanted: int, waited: float, taker: bool, members: set[str]) -> policy.ReplicaState:
        keys = {m: self.keys[self.klass[m]] for m in members}
        return policy.ReplicaState(wanted=wanted, waited_s=waited, live=False, taker=taker,
                                   comparison=policy.comparison_of(keys.values()), class_keys=keys)

    def work(self, node: rb.Node, uid: str, key: Any, chunks: list, seed: int, state: dict,
             cache: dict) -> rb.Work:
        """The node's work, trained inside its class (a class's results are cached apart)."""
        klass = self.klass[node.node_id]
        if node.attack is not None and node.attack.name in WAITS_FOR_TRUST and not vf.is_trusted(node.rep, self.vspec):
            node = rb.Node(node.node_id, None, node.rep)  # earning trust: an honest update
        if isinstance(node.attack, Coordinated):  # what every node can compute from the models it was sent
            base = policy.trend_base_round(len(self.models) - 1, self.vspec)
            node.attack.trend = None if base is None else {k: state[k] - self.models[base][k]
                                                           for k in state if state[k].is_floating_point()}
        sub = cache.setdefault(("class", klass), {})
        before = len(sub)
        base = self.w
        self.w = self.worlds[klass]
        t0 = time.process_time()
        try:
            with numeric_class(klass):
                w = super().work(node, uid, key, chunks, seed, state, sub)
        finally:
            self.w = base
        cfg = self.worlds[klass]["cfg"]
        steps = math.ceil(w.rec.shard_samples / cfg.batch_size) * int(cfg.local_epochs)
        self.h["steps"] += steps  # what the node trains (every replica trains, cached or not)
        if len(sub) > before:  # trained here, not taken from the cache: its CPU is a training's
            self.h["train_cpu_s"] += time.process_time() - t0
            self.h["fresh_steps"] += steps
        if w.malicious:
            self.h["malicious"][uid] = (node.attack.name if node.attack else "?", klass)
            if node.attack is not None and node.attack.name == FORGER and w.commitment is not None:
                w = forge(w, state)
        # the sha of its blob, as the hub's update records carry it (hub/domain/updates.py)
        return dataclasses.replace(w, rec=dataclasses.replace(w.rec, sha=w.sha))

    def settle_shard(self, group: list, wanted: int, active: list, issue: Any) -> Any:
        decision, group = super().settle_shard(group, wanted, active, issue)
        honest = [g for g in group if self.nodes[g.rec.node_id].attack is None]
        flagged = {f.update_id for f in decision.flags}
        for a, b in itertools.combinations(honest, 2):
            ka, kb = self.klass[a.rec.node_id], self.klass[b.rec.node_id]
            if self.keys[ka] == self.keys[kb]:
                continue
            dist, _ = vf.relative_distance(a.rec.delta, b.rec.delta)
            self.h["cross_class_pairs"] += 1
            self.h["cross_class_beyond_strict"] += dist > self.vspec.tolerance
            self.h["cross_class_bitwise_equal"] += dist == 0.0
            self.h["cross_class_flagged"] += (a.rec.update_id in flagged) + (b.rec.update_id in flagged)
            pair = " vs ".join(sorted((ka, kb)))
            self.h["max_distance"][pair] = max(self.h["max_distance"].get(pair, 0.0), dist)
        return decision, group

    def _decide_twice(self, decide: Callable[..., Any]) -> Callable[..., Any]:
        """decide_shard as the hub calls it (the members' fingerprints taken once per update and
        kept, ShardSettling), timed as "decide_shard"; then again on the same inputs with every
        pair measured in full and no fingerprint taken (the path before fingerprints), timed as
        "decide_shard_full_distances" and kept out of the verification CPU; the two decisions
        are compared."""
        m, prints, h = self.meter, self.fingerprints, self.h

        def fast(records: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
            t0 = m.clock()
            if kwargs.get("committed") and len(records) >= 2 and not needs_no_fingerprint(records):
                # the record with its fingerprint, made once per update (ShardSettling makes the hub's
                # records with theirs); keyed by the record it was made from
                for r in records:
                    if prints.get(r.update_id, (None,))[0] is not r:
                        prints[r.update_id] = (r, dataclasses.replace(r, fingerprint=fingerprint_of(r.delta, sha=r.sha)))
                records = [prints[r.update_id][1] for r in records]
            with _counting_pairs(h["pairs"]):
                decision = decide(records, *args, **kwargs)
            m.cpu["decide_shard"] = m.cpu.get("decide_shard", 0.0) + m.clock() - t0
            self._observe(decision)
            t0 = m.clock()
            with _full_distances():
                full = decide([dataclasses.replace(r, fingerprint=None, sha=None) for r in records], *args, **kwargs)
            m.full_cpu += m.clock() - t0
            h["differ"] += _decided(decision) != _decided(full)
            return decision

        return fast

    def run(self) -> dict[str, Any]:
        m = self.meter
        original = policy.decide_shard
        policy.decide_shard = self._decide_twice(original)
        try:
            with m.wrap(policy, "judge_round", self._observe), m.wrap(rb, "judge_segment"):
                out = super().run()
        finally:
            policy.decide_shard = original
        h = self.h
        escaped = set(out.get("escaped", ()))
        by: dict[str, dict[str, int]] = {}
        for uid, (name, klass) in h["malicious"].items():
            cell = by.setdefault(f"{name}/{klass}", {"submitted": 0, "caught": 0})
            cell["submitted"] += 1
            cell["caught"] += uid not in escaped
        cpu_per_step = h["train_cpu_s"] / h["fresh_steps"] if h["fresh_steps"] else 0.0
        train_cpu = cpu_per_step * h["steps"]  # every node's training, replicas included
        verify_cpu = sum(m.cpu.values())
        s = self.stats
        out.update({
            "cross_class_pairs": h["cross_class_pairs"], "cross_class_beyond_strict": h["cross_class_beyond_strict"],
            "cross_class_bitwise_equal": h["cross_class_bitwise_equal"],
            "cross_class_flagged": h["cross_class_flagged"], "max_distance": h["max_distance"],
            "by_attack_class": by,
            "honest_flags_by_reason": {f"{reason}/{klass}": sum(1 for (_, r), k in h["honest_flags"].items()
                                                               if (r, k) == (reason, klass))
                                       for reason, klass in sorted({(r, k) for (_, r), k in h["honest_flags"].items()})},
            "attackers_by_class": {c: sum(1 for n in self.nodes.values() if n.attack and self.klass[n.node_id] == c)
                                   for c in sorted(set(self.klass.values()))},
            "steps": h["steps"], "train_cpu_s": train_cpu, "verify_cpu_s": verify_cpu,
            "verify_cpu_by_call": {k: round(v, 4) for k, v in m.cpu.items()},
            # the same with every replica pair measured in full (the path before fingerprints)
            "verify_cpu_s_full_distances": verify_cpu - m.cpu.get("decide_shard", 0.0) + m.full_cpu,
            "decide_shard_cpu_s_full_distances": round(m.full_cpu, 4),
            "fingerprint_decisions_differ": h["differ"], "replica_pairs_by_measure": dict(h["pairs"]),
            "referee_steps": s.get("steps_replayed"), "referee_checks": s.get("referee_checks"),
            "referee_by_reason": dict(s.get("referee_by_reason", {})),
            "shards": s["shards"], "trainings": s["trainings"], "shards_trusted": s["shards_trusted"],
            "trainings_trusted": s["trainings_trusted"],
        })
        return out


# --------------------------------------------------------------------------- one job


@dataclass(frozen=True)
class Setup:
    rounds: int = 30
    epochs: int = 5
    chunks: int = 12
    classes: tuple[str, ...] = tuple(CLASSES)
    attacks: tuple[str, ...] = atk.ATTACKS
    coordinated: bool = True
    n_nodes: int = N_NODES
    #: one 64-sample chunk a shard: twice the replica groups (agreements) of robustness.py's 2 for
    #: the same training, so trust forms within 30 rounds among 20 nodes
    chunks_per_shard: int = 1


def n_bad(fraction: float, n: int) -> int:
    return max(2, round(fraction * n))


def run_job(job: str, setup: Setup, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of one job: the baselines, the mixed-class clean run, each attack, the adversary."""
    world = make_world(job, epochs=setup.epochs, chunks=setup.chunks)
    with shard_size(setup.chunks_per_shard):
        return _run_job(job, world, setup, log)


@contextlib.contextmanager
def shard_size(chunks_per_shard: int) -> Iterator[None]:
    """robustness.Simulation cuts a round's shards of its module's CHUNKS_PER_SHARD chunks."""
    before = rb.CHUNKS_PER_SHARD
    rb.CHUNKS_PER_SHARD = chunks_per_shard
    try:
        yield
    finally:
        rb.CHUNKS_PER_SHARD = before


def _run_job(job: str, world: dict[str, Any], setup: Setup, log: Callable[[str], None]) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}

    def go(name: str, sim: HeteroSimulation) -> dict[str, Any]:
        t = time.perf_counter()
        r = sim.run()
        r["wall_s"] = round(time.perf_counter() - t, 1)
        runs[name] = r
        log(row_line(job, name, r) + f"  [{time.perf_counter() - t0:.0f} s]")
        return r

    fp32 = setup.classes[0]
    plain = go("plain_fp32", HeteroSimulation(world, None, 0, setup.rounds, classes=[fp32],
                                              n_nodes=setup.n_nodes, referee=False,
                                              vspec=dataclasses.replace(VSPEC, replication=0.0)))
    per_class = {fp32: plain["accuracy"]}
    for klass in setup.classes[1:]:
        per_class[klass] = go(f"only_{klass}", HeteroSimulation(world, None, 0, setup.rounds, classes=[klass],
                                                                n_nodes=setup.n_nodes))["accuracy"]
    go("mixed_clean", HeteroSimulation(world, None, 0, setup.rounds, classes=setup.classes, n_nodes=setup.n_nodes))
    for attack in setup.attacks:
        k = n_bad(ATTACK_FRACTION, setup.n_nodes)
        go(attack, HeteroSimulation(world, attack, k, setup.rounds, classes=setup.classes, n_nodes=setup.n_nodes))
    for adversary in ADVERSARIES if setup.coordinated else ():
        k = n_bad(COORDINATED_FRACTION, setup.n_nodes)
        go(adversary, HeteroSimulation(world, adversary, k, setup.rounds, classes=setup.classes,
                                       n_nodes=setup.n_nodes))
    if setup.coordinated:  # the adaptive adversary again, with every trusted update audited
        k = n_bad(COORDINATED_FRACTION, setup.n_nodes)
        go(FULL_AUDIT, HeteroSimulation(world, ADAPTIVE, k, setup.rounds, classes=setup.classes, n_nodes=setup.n_nodes,
                                        vspec=dataclasses.replace(VSPEC, spot_check_trusted=1.0)))
        go(FULL_AUDIT_FINE, HeteroSimulation(world, ADAPTIVE, k, setup.rounds, classes=setup.classes,
                                             n_nodes=setup.n_nodes, vspec=dataclasses.replace(
                                                 VSPEC, spot_check_trusted=1.0, checkpoint_every=1)))
        go(FORGER_FULL_AUDIT, HeteroSimulation(world, FORGER, k, setup.rounds, classes=setup.classes,
                                               n_nodes=setup.n_nodes,
                                               vspec=dataclasses.replace(VSPEC, spot_check_trusted=1.0)))
    return {
        "model": world["spec"].kind, "train_chunks": len(world["chunks"]), "val_samples": int(world["yva"].shape[0]),
        "per_class_accuracy": {k: round(v, 4) for k, v in per_class.items()},
        "accuracy_gap_points": {k: round(100 * (v - per_class[fp32]), 2) for k, v in per_class.items()},
        "runs": runs, "elapsed_s": round(time.perf_counter() - t0, 1),
    }


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


HEADER = (f"{'job':<4} {'run':<19} {'acc':>6} {'detect':>6} {'honest fl':>9} {'xc pairs':>8} {'>strict':>7} "
          f"{'overhead':>8} {'steady':>6} {'verify':>6} {'wall s':>6}")


def row_line(job: str, name: str, r: dict[str, Any]) -> str:
    verify = r["verify_cpu_s"] / r["train_cpu_s"] if r["train_cpu_s"] else None
    return (f"{job:<4} {name:<19} {r['accuracy']:>6.3f} {_f(r['detection_rate'], '.3f'):>6} "
            f"{r['honest_flagged']:>9} {r['cross_class_pairs']:>8} {r['cross_class_beyond_strict']:>7} "
            f"{r['replication_overhead']:>8.3f} {_f(r['replication_overhead_trusted'], '.3f'):>6} "
            f"{_f(verify, '.3f'):>6} {r['wall_s']:>6}")


# --------------------------------------------------------------------------- figures


def figures(jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures over every job and run (baselines excluded where they would flatter)."""
    verified = [(j, n, r) for j, d in jobs.items() for n, r in d["runs"].items()
                if n not in ("plain_fp32", *AUDIT_RUNS)]
    audited = [r for d in jobs.values() for n, r in d["runs"].items() if n == FULL_AUDIT]
    fine = [r for d in jobs.values() for n, r in d["runs"].items() if n == FULL_AUDIT_FINE]
    forger = [r for d in jobs.values() for n, r in d["runs"].items() if n == FORGER_FULL_AUDIT]
    attacked = [(j, n, r) for j, n, r in verified if r["malicious_updates"]]
    cells: dict[str, dict[str, int]] = {}
    for _, n, r in attacked:
        if n in ADVERSARIES:
            continue
        for cell, c in r["by_attack_class"].items():
            acc = cells.setdefault(cell, {"submitted": 0, "caught": 0})
            acc["submitted"] += c["submitted"]
            acc["caught"] += c["caught"]
    submitted = sum(c["submitted"] for c in cells.values())
    caught = sum(c["caught"] for c in cells.values())
    inclusion = {a: (sum(len(r.get("escaped", ())) for _, n, r in attacked if n == a),
                     sum(r["malicious_updates"] for _, n, r in attacked if n == a)) for a in ADVERSARIES}
    rates = [i / c for i, c in inclusion.values() if c]
    trusted_shards = sum(r["shards_trusted"] for _, _, r in verified)
    trusted_extra = sum(r["trainings_trusted"] - r["shards_trusted"] for _, _, r in verified)
    mixed = [(j, n, r) for j, n, r in verified if not n.startswith("only_")]
    train_cpu = sum(r["train_cpu_s"] for _, _, r in mixed)
    verify_cpu = sum(r["verify_cpu_s"] for _, _, r in mixed)
    referee_steps = [r["referee_steps"] for _, _, r in mixed if r["referee_steps"] is not None]
    steps = sum(r["steps"] for _, _, r in mixed)
    plain_steps = sum(d["runs"]["plain_fp32"]["steps"] for d in jobs.values())
    clean_steps = sum(d["runs"]["mixed_clean"]["steps"] + (d["runs"]["mixed_clean"]["referee_steps"] or 0)
                      for d in jobs.values())

    def included(rs: list[dict[str, Any]]) -> int:  # crafted updates that reached the aggregate
        return sum(len(r.get("escaped", ())) for r in rs)

    def inclusion_rate(rs: list[dict[str, Any]]) -> float | None:
        return included(rs) / max(sum(r["malicious_updates"] for r in rs), 1) if rs else None

    def counts(rs: list[dict[str, Any]]) -> dict[str, int]:
        return {"aggregated": included(rs), "submitted": sum(r["malicious_updates"] for r in rs)}

    def cost(rs: list[dict[str, Any]], key: str = "verify_cpu_s") -> float | None:  # verification over training CPU
        return sum(r[key] for r in rs) / max(sum(r["train_cpu_s"] for r in rs), 1e-12) if rs else None

    full = "verify_cpu_s_full_distances"  # the same runs with every replica pair measured in full
    every = [r for d in jobs.values() for r in d["runs"].values()]

    def cpu_of(run: str) -> float:  # training + verification CPU of one run, over every job
        return sum(d["runs"][run]["train_cpu_s"] + d["runs"][run]["verify_cpu_s"] for d in jobs.values())

    return {
        "cross_class_pairs": sum(r["cross_class_pairs"] for _, _, r in verified),
        "cross_class_beyond_strict": sum(r["cross_class_beyond_strict"] for _, _, r in verified),
        "cross_class_bitwise_equal": sum(r["cross_class_bitwise_equal"] for _, _, r in verified),
        "honest_flagged": sum(r["honest_flagged"] for _, _, r in verified),
        "honest_flagged_by_reason": {f"{j}/{n}/{k}": c for j, n, r in verified
                                     for k, c in r["honest_flags_by_reason"].items()},
        "detection_rate": caught / submitted if submitted else None,
        "detection_by_attack_class": {k: round(c["caught"] / c["submitted"], 4) for k, c in sorted(cells.items())},
        "detection_min_cell": min((c["caught"] / c["submitted"] for c in cells.values()), default=None),
        "malicious_updates": submitted,
        "replication_overhead_steady": trusted_extra / trusted_shards if trusted_shards else None,
        "replication_overhead_steady_max_run": max(
            (r["replication_overhead_trusted"] for _, _, r in verified if r["replication_overhead_trusted"] is not None),
            default=None),
        "verification_cost_fraction": verify_cpu / train_cpu if train_cpu else None,
        "verification_cost_fraction_full_distances": cost([r for _, _, r in mixed], full),
        "verification_cost_fraction_full_audit_full_distances": cost(audited, full),
        "verification_cost_fraction_full_audit_every1_full_distances": cost(fine, full),
        "verification_cost_fraction_forger_full_audit_full_distances": cost(forger, full),
        # decide_shard alone, every run: with fingerprints over measuring every pair in full
        "decide_shard_cpu_vs_full_distances": sum(r["verify_cpu_by_call"].get("decide_shard", 0.0) for r in every)
        / max(sum(r["decide_shard_cpu_s_full_distances"] for r in every), 1e-12),
        "fingerprint_decisions_differ": sum(r["fingerprint_decisions_differ"] for r in every),
        "replica_pairs_by_measure": {k: sum(r["replica_pairs_by_measure"].get(k, 0) for r in every)
                                     for k in sorted({k for r in every for k in r["replica_pairs_by_measure"]})},
        "verification_cost_fraction_by_job": {
            j: round(sum(r["verify_cpu_s"] for jj, _, r in mixed if jj == j)
                     / max(sum(r["train_cpu_s"] for jj, _, r in mixed if jj == j), 1e-12), 4) for j in jobs},
        "verification_cost_fraction_steps": (sum(referee_steps) / steps) if referee_steps and steps else None,
        "referee_checks_by_reason": {k: sum(r["referee_by_reason"].get(k, 0) for _, _, r in mixed)
                                     for k in sorted({k for _, _, r in mixed for k in r["referee_by_reason"]})},
        # the model's trend (hub/policy/round_policy.py rule 4): how many honest trainings it sent to the referee
        "trend_audit_honest_rate": sum(r["referee_by_reason"].get("against_trend/honest", 0) for _, _, r in mixed)
        / max(sum(r["trainings"] for _, _, r in mixed), 1),
        "accuracy_gap_points": {f"{j}/{k}": v for j, d in jobs.items() for k, v in d["accuracy_gap_points"].items()},
        "accuracy_gap_points_max_abs": max((abs(v) for d in jobs.values() for v in d["accuracy_gap_points"].values()),
                                           default=None),
        "mixed_accuracy_gap_points": {j: round(100 * (d["runs"]["mixed_clean"]["accuracy"]
                                                      - d["runs"]["plain_fp32"]["accuracy"]), 2)
                                      for j, d in jobs.items()},
        # the worst of the strategies; per strategy: [crafted updates aggregated, submitted]
        "colluder_inclusion_rate": max(rates) if rates else None,
        "colluder_inclusion": {a: {"aggregated": i, "submitted": c} for a, (i, c) in inclusion.items()},
        # what each strategy's included updates did: the run's accuracy below the clean mixed run's, per job
        "colluder_accuracy_drop_points": {
            a: {j: round(100 * (d["runs"]["mixed_clean"]["accuracy"] - d["runs"][a]["accuracy"]), 2)
                for j, d in jobs.items() if a in d["runs"]} for a in ADVERSARIES},
        # the patient adversary at spot_check_trusted = 1 (the job's strictest setting), and its cost
        "colluder_inclusion_rate_full_audit": inclusion_rate(audited),
        "colluder_inclusion_full_audit": counts(audited),
        "verification_cost_fraction_full_audit": cost(audited),
        "verification_cost_fraction_patient_default": (
            sum(r["verify_cpu_s"] for _, n, r in verified if n == PATIENT)
            / max(sum(r["train_cpu_s"] for _, n, r in verified if n == PATIENT), 1e-12)),
        "referee_steps_fraction_full_audit": (
            sum(r["referee_steps"] or 0 for r in audited) / max(sum(r["steps"] for r in audited), 1)
            if audited else None),
        # the full audit on one-step segments: the hub's cost, and what committing every step costs
        # the nodes (their training CPU against the default grid's, the same steps and adversary)
        "verification_cost_fraction_full_audit_every1": cost(fine),
        "colluder_inclusion_rate_full_audit_every1": inclusion_rate(fine),
        "node_commit_cost_every1_vs_default": (
            sum(r["train_cpu_s"] for r in fine) / max(sum(r["train_cpu_s"] for r in audited), 1e-12) - 1
            if fine and audited else None),
        # the forger (a consistent forged commitment) with every trusted update re-executed on one
        # segment: caught only where the drawn segment is its last (1 in the segment count)
        "colluder_inclusion_rate_forger_full_audit": inclusion_rate(forger),
        "colluder_inclusion_forger_full_audit": counts(forger),
        "verification_cost_fraction_forger_full_audit": cost(forger),
        "forger_accuracy_drop_points_full_audit": {
            j: round(100 * (d["runs"]["mixed_clean"]["accuracy"] - d["runs"][FORGER_FULL_AUDIT]["accuracy"]), 2)
            for j, d in jobs.items() if FORGER_FULL_AUDIT in d["runs"]},
        "training_steps_vs_plain_fp32": clean_steps / plain_steps if plain_steps else None,
        "compute_vs_plain_fp32": cpu_of("mixed_clean") / cpu_of("plain_fp32") if cpu_of("plain_fp32") else None,
    }


TARGETS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "cross_class_pairs": (">= 1000", lambda v: v >= 1000),
    "honest_flagged": ("= 0", lambda v: v == 0),
    "detection_rate": (">= 0.99", lambda v: v >= 0.99),
    "detection_min_cell": (">= 0.99 (every attack and class)", lambda v: v >= 0.99),
    "replication_overhead_steady": ("< 0.15", lambda v: v < 0.15),
    "verification_cost_fraction": ("<= 0.10", lambda v: v <= 0.10),
    "accuracy_gap_points_max_abs": ("<= 1 (every class and job)", lambda v: v <= 1.0),
    "colluder_inclusion_rate": ("<= 0.01", lambda v: v <= 0.01),
}


def verdicts(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: {"value": fig.get(k), "target": t, "met": None if fig.get(k) is None else bool(ok(fig[k]))}
            for k, (t, ok) in TARGETS.items()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=12, help="64-sample training chunks per job")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--classes", default=",".join(CLASSES), help="the first is the accuracy baseline's")
    ap.add_argument("--attacks", default=",".join(atk.ATTACKS))
    ap.add_argument("--no-coordinated", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # torch imports its compiler stack the first time an optimizer is made (about 1.7 s of CPU here):
    # pay it before anything is measured, or the first timed call (a training or a referee replay) carries it
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    setup = Setup(rounds=args.rounds, epochs=args.epochs, chunks=args.chunks,
                  classes=tuple(c for c in args.classes.split(",") if c),
                  attacks=tuple(a for a in args.attacks.split(",") if a), coordinated=not args.no_coordinated)
    unknown = [c for c in setup.classes if c not in CLASSES]
    if unknown:
        ap.error(f"unknown class {unknown[0]!r}; one of {', '.join(CLASSES)}")
    keys = {c: key_of(c) for c in setup.classes}
    for c, k in keys.items():
        print(f"class {c:<11} {k}")
    t0 = time.perf_counter()
    print(HEADER, flush=True)
    jobs = {job: run_job(job, setup, lambda line: print(line, flush=True)) for job in args.jobs.split(",")}
    fig = figures(jobs)
    check = verdicts(fig)
    result = {
        "bench": "heterogeneity",
        "mode": "in-process: bench/robustness.py's Simulation (the hub's round policy: decide_shard with the"
                " members' class keys, judge_round, aggregate, ServerOptimizer, in RoundEngine's order) with a"
                " compute class per node; real training with the node's trainer inside each class",
        "machine": {"cpu": platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "python": platform.python_version(), "loadavg_at_end": list(os.getloadavg()),
                    "isa_caps": {k: v for k in ISA_CAPS if (v := os.environ.get(k))}},
        "classes": {c: {"precision": CLASSES[c][0], "threads": CLASSES[c][1], "onednn": CLASSES[c][2],
                        "class_key": keys[c]} for c in setup.classes},
        "config": {**dataclasses.asdict(setup), "nodes": setup.n_nodes, "chunk_size": 64,
                   "attack_fraction": ATTACK_FRACTION,
                   "coordinated_fraction": COORDINATED_FRACTION, "collude_scale": COLLUDE_SCALE,
                   "train": "SGD lr 0.05 momentum 0.9 batch 32", "verification": dataclasses.asdict(VSPEC),
                   "replica_placement": "any class (no same-class node online: cross-class verification)"},
        "targets": {k: t for k, (t, _) in TARGETS.items()},
        "figures": fig,
        "met": check,
        "jobs": jobs,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print()
    for k, c in check.items():
        mark = "-" if c["met"] is None else ("met" if c["met"] else "NOT met")
        print(f"{k:<30} {_f(c['value'], '.4g') if not isinstance(c['value'], int) else c['value']:>10}"
              f"  target {c['target']:<34} {mark}")
    print(f"wrote {args.out} ({result['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
