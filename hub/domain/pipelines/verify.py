"""Verified stage work: the hub re-executes sampled pipeline stages on one micro-batch each.

At a step whose parameters are durable (a generation's first step, resumed from the committed
states or the job's model, and every checkpoint step before its end: each unit's state after
that many steps is stored), every stage runs that step's forwards and backwards with exactly
those parameters. When a generation starts, the hub draws which (stage, step) pairs of its
verifiable steps it checks: each with probability ``[pipeline] verify_rate``, and one
micro-batch of each, under a secret of this hub process (a keyed hash), so no node can tell
whether its work is checked. The draw is never sent anywhere.

For a drawn (stage, step, micro-batch) the relay hands ``observe`` every tensor it accepted, and
the check keeps copies (memory only, at most ``max_bytes`` in all; a pick that would exceed it is
dropped unchecked) of what the stage received and sent: its input activation, its output
activation, the gradient of its output that came back, its input's gradient that it sent back.
Once those are in and the states of the step are durable, the referee rebuilds the stage from the
units' states in a worker thread and compares (hub/policy/stage_check.py). A mismatch flags the
stage's node ``stage_mismatch`` with the evidence (stage, step, micro-batch, distances,
threshold), which suspends it (hub/policy/suspension.py); the pipeline then loses the stage and
re-plans without the node.

With an encoded boundary (``[pipeline] boundary`` other than fp32) the relay carries, and the
pick keeps, each tensor's wire form: the referee decodes what the stage received as the stage
did and measures what it sent against its own recomputation under the same code (each cut's, as
the node builds it: the job's seed, the cut's index within the pipeline), within the same
tolerance (hub/policy/stage_check.py says how, docs/pipeline.md what that can and cannot see).
Where the stage sketched what it sent (the relay header's ``sketch``, protocol/stagesketch.py:
the raw tensor's largest entries before any code), the pick keeps the sketch beside the tensor
and the referee compares its recomputed raw tensor there too.

What is not checked: tensors that travel directly between stages (``--stage-listen``) never pass
the relay, so a pick whose tensors do not all come through it stays incomplete and is dropped
when its generation ends (``unobserved``); tied parameters' gradient sums and the optimizer step
are not re-executed here (the next checkpoint's states are what the next check starts from).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from gpuflex.protocol.boundarycodec import BoundaryCode
from gpuflex.protocol.messages import RelayHeader
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.pipeline import (
    Units,
    cut_state,
    micro_batch_slices,
    pipeline_units,
    step_samples,
)
from gpuflex.protocol.stagesketch import decode_sketch
from gpuflex.protocol.tensors import TensorSpec, decode_state
from torch import Tensor

from ...model.job import JobState
from ...model.pipeline import Generation, UnitRecord
from ...policy import suspension
from ...policy.stage_check import (
    STAGE_MISMATCH,
    StageEvidence,
    StageVerdict,
    judge_stage,
    stage_loss,
    stage_tolerance,
)
from ...policy.verification import Flag
from ...storage.blobs import BlobStore
from ...storage.store import Store
from ..scheduler import Scheduler
from .offers import unit_outputs

log = logging.getLogger("gpuflex.hub.pipelines.verify")

#: what a pick keeps: (carries, from stage offset, to stage offset) relative to the stage checked
ROLES = {
    ("activation", -1, 0): "x",
    ("activation", 0, 1): "out",
    ("gradient", 1, 0): "grad_out",
    ("gradient", 0, -1): "grad_in",
}
#: the roles of what the checked stage itself sent: the ones whose sketch is its own
SENT = ("out", "grad_in")
#: (job, generation, step, micro-batch, stage)
PickKey = tuple[str, int, int, int, int]


@dataclass
class Pick:
    """One drawn (stage, step, micro-batch) of a generation, and what the hub holds of it.
    ``stage`` is the generation's slot (pipelines sharing the steps: every pipeline's stages in
    turn), ``stages`` the stages of one pipeline, ``micro_batch`` its place among the step's
    ``micro_batches`` (every pipeline's)."""

    job_id: str
    generation: int
    stage: int
    stages: int
    step: int
    micro_batch: int
    micro_batches: int
    node_id: str
    units: tuple[int, int]
    kept: dict[str, bytes] = field(default_factory=dict)
    #: role -> the stage's sketch of what it sent (``out``, ``grad_in``), when it sent one
    sketches: dict[str, bytes] = field(default_factory=dict)
    #: unit -> its state at ``step`` (None: the job's model at step 0; unset until durable)
    states: Mapping[int, UnitRecord] | None = None
    durable: bool = False

    @property
    def local(self) -> int:
        """The stage within its pipeline."""
        return self.stage % self.stages

    def needs(self) -> set[str]:
        want = set()
        if self.local > 0:
            want |= {"x", "grad_in"}
        if self.local < self.stages - 1:
            want |= {"out", "grad_out"}
        return want

    def ready(self) -> bool:
        return self.durable and self.needs() <= set(self.kept)

    @property
    def what(self) -> str:
        return (
            f"{self.job_id} generation {self.generation} stage {self.stage} step {self.step}"
            f" micro-batch {self.micro_batch}"
        )


def verifiable_steps(g: Generation, every: int) -> list[int]:
    """The steps of ``g`` run with durable parameters: its first, and each checkpoint step
    before its end."""
    return [g.first_step, *(c for c in range(g.first_step + 1, g.end_step) if c % every == 0)]


class StageChecks:
    """The drawn picks of every live generation, the tensors kept for them, and the checks."""

    def __init__(
        self,
        *,
        store: Store,
        blobs: BlobStore,
        scheduler: Scheduler,
        on_flag: Callable[[], None],
        max_bytes: int = 64 << 20,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.scheduler = scheduler
        self.on_flag = on_flag
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self.secret = secrets.token_bytes(32)
        self.picks: dict[PickKey, Pick] = {}
        self.counts = {"drawn": 0, "checked": 0, "flagged": 0, "dropped": 0, "unobserved": 0}
        self.verdicts: list[tuple[str, StageVerdict]] = []  # (pick, verdict), the latest 256
        self._ready: asyncio.Queue[Pick] = asyncio.Queue()

    # -- the draw --------------------------------------------------------------------------------
    def _draw(self, *parts: object) -> float:
        digest = hmac.new(self.secret, "|".join(map(str, parts)).encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") / float(1 << 64)

    def start(self, job: JobState, g: Generation, first: Mapping[int, UnitRecord]) -> None:
        """Generation ``g`` goes live: draw its picks. ``first``: the units' states at its first
        step (empty at step 0: the job's model)."""
        spec = job.spec.pipeline
        if spec is None or spec.verify_rate <= 0:
            return
        for step in verifiable_steps(g, spec.checkpoint_every):
            for s, slot in enumerate(g.stages):
                if self._draw(job.id, g.number, s, step) >= spec.verify_rate:
                    continue
                lo, count = g.lane_range(g.lane_of(s)[0])
                mb = lo + int(self._draw(job.id, g.number, s, step, "mb") * count)
                pick = Pick(
                    job.id,
                    g.number,
                    s,
                    g.per_lane,
                    step,
                    mb,
                    sum(g.counts),
                    slot.node_id,
                    (slot.unit_start, slot.unit_end),
                )
                if step == g.first_step:
                    pick.states, pick.durable = dict(first), True
                self.picks[(job.id, g.number, step, mb, s)] = pick
                self.counts["drawn"] += 1

    def durable(
        self, job_id: str, generation: int, step: int, states: Mapping[int, UnitRecord]
    ) -> None:
        """Every unit's state after ``step`` steps is stored: the picks of that step may run."""
        for pick in list(self.picks.values()):  # a pick whose tensors are all in leaves the dict
            if (pick.job_id, pick.generation, pick.step) == (job_id, generation, step):
                pick.states, pick.durable = dict(states), True
                self._maybe_ready(pick)

    def drop(self, job_id: str) -> None:
        """The job's generation ended: its picks still waiting for tensors are dropped."""
        for key in [k for k in self.picks if k[0] == job_id]:
            pick = self.picks.pop(key)
            self._release(pick)
            self.counts["unobserved"] += 1

    # -- what the relay accepted -----------------------------------------------------------------
    def observe(self, hdr: RelayHeader, body: bytes) -> None:
        """A tensor the relay accepted (checked against its signed hash and the plan): kept when
        it belongs to a pick."""
        if hdr.carries not in ("activation", "gradient") or not self.picks:
            return
        for (carries, a, b), role in ROLES.items():
            if carries != hdr.carries or hdr.to_stage - hdr.stage != b - a:
                continue
            stage = hdr.stage - a
            pick = self.picks.get((hdr.job_id, hdr.generation, hdr.step, hdr.micro_batch, stage))
            if pick is None or role in pick.kept:
                continue
            sketch = hdr.sketch if role in SENT else b""
            if self.held_bytes + len(body) + len(sketch) > self.max_bytes:
                self.picks.pop((hdr.job_id, hdr.generation, hdr.step, hdr.micro_batch, stage))
                self._release(pick)
                self.counts["dropped"] += 1
                continue
            pick.kept[role] = body
            if sketch:
                pick.sketches[role] = sketch
            self.held_bytes += len(body) + len(sketch)
            self._maybe_ready(pick)

    def _maybe_ready(self, pick: Pick) -> None:
        if pick.ready():
            self.picks.pop(
                (pick.job_id, pick.generation, pick.step, pick.micro_batch, pick.stage), None
            )
            self._ready.put_nowait(pick)

    def _release(self, pick: Pick) -> None:
        self.held_bytes -= sum(len(b) for b in (*pick.kept.values(), *pick.sketches.values()))
        pick.kept.clear()
        pick.sketches.clear()

    # -- the checks ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Background loop: check each pick once its tensors and states are in."""
        while True:
            pick = await self._ready.get()
            try:
                await self.check(pick)
            except Exception:  # one check's trouble must not stop the others
                log.exception("the check of %s failed", pick.what)
            finally:
                self._release(pick)

    async def check(self, pick: Pick) -> None:
        job = self.scheduler.jobs.get(pick.job_id)
        if job is None:
            return
        verdict = await asyncio.to_thread(self._judge, job, pick)
        self.counts["checked"] += 1
        self.verdicts = [*self.verdicts[-255:], (pick.what, verdict)]
        if verdict.ok:
            log.info("stage check: %s reproduced: %s", pick.what, dict(verdict.evidence))
            return
        evidence = {
            "check": "stage_replay",
            "job": pick.job_id,
            "generation": pick.generation,
            "stage": pick.stage,
            "step": pick.step,
            "micro_batch": pick.micro_batch,
            "units": list(pick.units),
            "precision": job.spec.train.train_config().precision,
            "boundary": job.spec.pipeline.boundary if job.spec.pipeline else "fp32",
            **verdict.evidence,
        }
        checked = f"{pick.job_id}/g{pick.generation}/stage{pick.stage}/step{pick.step}/mb{pick.micro_batch}"
        flag = Flag(checked, pick.node_id, STAGE_MISMATCH, evidence)
        await self.store.flag_stage(pick.job_id, pick.step, flag, now=time.time())
        self.counts["flagged"] += 1
        node = self.scheduler.nodes.get(pick.node_id)
        if node is not None and node.suspended is None and suspension.flag_suspends(flag):
            node.suspended = suspension.why(STAGE_MISMATCH, checked)
        log.warning("stage check: %s did not reproduce: %s", pick.what, verdict.evidence)
        self.on_flag()

    def _judge(self, job: JobState, pick: Pick) -> StageVerdict:
        """Blocking (a worker thread): rebuild the stage from its durable states and compare."""
        spec: ModelSpec = job.spec.model
        every = pipeline_units(spec)
        units = every.units[pick.units[0] : pick.units[1]]
        states: list[dict[str, Tensor]] = []
        model: dict[str, Tensor] | None = None
        for index, unit in enumerate(units, start=pick.units[0]):
            record = (pick.states or {}).get(index)
            if record is None:  # step 0: the job's model
                model = (
                    model if model is not None else decode_state(self.blobs.read(job.model_hash))
                )
                states.append(cut_state(unit, model))
            else:
                blob = decode_state(self.blobs.read(record.sha))
                states.append({k: v for k, v in blob.items() if not k.startswith("optim.")})
        kept = {role: decode_state(body)[role_name(role)] for role, body in pick.kept.items()}
        sketches = {role: decode_sketch(b) for role, b in pick.sketches.items()}  # relay-checked
        x, y, weight = self._data(job, pick)
        inbound, outbound = self._codes(job, pick, every, kept)
        evidence = StageEvidence(
            x=kept.get("x", x),
            out=kept.get("out"),
            grad_out=kept.get("grad_out"),
            grad_in=kept.get("grad_in"),
            y=y,
            weight=weight,
            inbound=inbound,
            outbound=outbound,
            out_sketch=sketches.get("out"),
            grad_in_sketch=sketches.get("grad_in"),
        )
        train = job.spec.train
        tolerance = stage_tolerance(
            train.train_config().precision,
            job.spec.verification.tolerance,
            job.spec.verification.segment_tolerance_low,
        )
        last = pick.local == pick.stages - 1
        return judge_stage(
            units,
            states,
            evidence,
            seed=train.seed,
            step=pick.step,
            micro_batch=pick.micro_batch,
            tolerance=tolerance,
            loss_fn=stage_loss(spec, train.loss) if last else None,
        )

    @staticmethod
    def _codes(
        job: JobState, pick: Pick, units: Units, kept: Mapping[str, Tensor]
    ) -> tuple[BoundaryCode | None, BoundaryCode | None]:
        """The codes of the cuts before and after the pick's stage, as its node builds them
        (node/pipeline/worker.py): the job's boundary over the raw tensor crossing each cut
        (the unit's output before it, one micro-batch: the kept wire's leading dimensions), the
        job's seed, the cut's index within the pipeline. None for fp32, or where no cut is."""
        pipeline = job.spec.pipeline
        if pipeline is None or pipeline.boundary == "fp32":
            return None, None
        spec = job.spec.model
        outputs = unit_outputs(units, spec.input_shape, spec.input_dtype)

        def code(cut: int, unit: int, wire: Tensor) -> BoundaryCode:
            shape, dtype = outputs[unit]
            raw = TensorSpec("activation", dtype, (int(wire.shape[0]), *shape))
            return BoundaryCode(
                pipeline.boundary,
                pipeline.boundary_rank,
                raw=raw,
                seed=job.spec.train.seed,
                cut=cut,
            )

        before = code(pick.local - 1, pick.units[0] - 1, kept["x"]) if "x" in kept else None
        after = code(pick.local, pick.units[1] - 1, kept["out"]) if "out" in kept else None
        return before, after

    def _data(self, job: JobState, pick: Pick) -> tuple[Tensor, Tensor | None, float]:
        """Stage 0's samples and the last stage's targets of the pick's micro-batch, from the
        job's chunks (step_samples, micro_batch_slices), and the micro-batch's loss weight."""
        last = pick.local == pick.stages - 1
        batch = job.spec.train.batch_size
        lo, hi = micro_batch_slices(batch, pick.micro_batches)[pick.micro_batch]
        if pick.local > 0 and not last:
            return torch.empty(0), None, (hi - lo) / batch
        chunks = [decode_state(self.blobs.read(c.sha)) for c in job.chunks]
        x = torch.cat([c["x"] for c in chunks])
        y = torch.cat([c["y"] for c in chunks])
        index = torch.tensor(step_samples(job.spec.train.seed, pick.step, batch, int(x.shape[0])))
        part = index[lo:hi]
        return x[part], (y[part] if last else None), (hi - lo) / batch


def role_name(role: str) -> str:
    """The tensor's name in a relayed GFT1 body for a kept role."""
    return "gradient" if role.startswith("grad") else "activation"


__all__ = ["Pick", "StageChecks", "verifiable_steps"]
