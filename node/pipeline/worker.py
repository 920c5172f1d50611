"""StageWorker: one node's run of one StageAssignment, from its units' state to its last step.

It builds the stage from the assignment alone: the model's units (protocol/pipeline.py's
``pipeline_units`` on the spec), this stage's units loaded from their unit-state blobs (or, at
step 0, cut from the job's model blob) with their optimizer state (node/pipeline/unitstate.py),
the tied groups that span stages and the tensors that cross each cut (one micro-batch's, found
on the meta device), and the job's loss on the last stage. The first and the last stage read
the job's chunks; step ``s`` trains ``step_samples(seed, s, batch_size, samples)`` of them split
by ``micro_batch_slices``, so every stage and a single process replaying the job agree. When
several pipelines share the steps (``lanes``), each trains its own micro-batches of them
(``lane_slices``), the stages sum their gradients across pipelines, and only the first pipeline
uploads checkpoints (every pipeline holds the same state after each step).

Then it runs steps ``first_step`` up to ``end_step`` through its ``Transport``. After each step:
every ``checkpoint_every`` steps and at ``end_step`` each unit's state goes to the node's blob
cache and to the hub (UnitCheckpoint), then a StageReport says how far it is; an Ack with
ok=False ends the generation. A report goes out on a thread of its own while the next step
runs (its answer read before that step is reported, checkpointed or counted, so a step after
the generation's end is never counted); the last step's report, and a failure's, are waited for. A ``PipelineError`` (a neighbour's tensor that does not come, a
bad tensor, a NaN loss) is reported as the stage's failure; a ``StaleGeneration`` (the hub
re-planned) ends it quietly.

The hub is reached only through ``StageHub``, so tests run stages with plain Python objects
that hold real bytes. Blocking: the caller runs ``run`` in a worker thread.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Protocol

import torch
from gpuflex.protocol.boundarycodec import BoundaryCode
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import StageAssignment, StageReport, UnitCheckpoint
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.pipeline import (
    LanePlace,
    Units,
    lane_counts,
    lane_place,
    lane_slices,
    pipeline_units,
    step_samples,
)
from gpuflex.protocol.signing import new_nonce
from gpuflex.protocol.tensors import Buffer, TensorSpec, decode_state, encode_state, sha256_hex
from torch import Tensor, nn

from ..computeshare import ComputeShare
from ..errors import NodeError, PipelineError, StaleGeneration
from ..stagelinks import checked_step
from ..trainer import loss_for, make_optimizer, prepare_device, stack_chunks
from .overhead import unit_overhead_s
from .stage import StageRunner, boundary_specs
from .transport import MessageKey, SendAhead, Transport
from .unitstate import (
    UnitTensors,
    build_stage,
    cross_stage_ties,
    load_optimizer_state,
    read_unit_state,
    stage_starts_ok,
    state_from_model,
    unit_blob_state,
)

log = logging.getLogger(__name__)

#: how a stage's run ended: every step done, the hub ended the generation (an Ack with
#: ok=False, or 409 stale_generation), it failed (and said so), or the node stopped it
ENDINGS: Final = ("done", "over", "stale", "failed", "stopped")


class StageHub(Protocol):
    """The hub as a stage sees it (blocking calls, from the stage's thread).

    Each raises StaleGeneration when the hub says the generation is over (409
    ``stale_generation``) and PipelineError for anything else that stops the stage."""

    def blob(self, sha256: str, size: int) -> Buffer:
        """Blob ``sha256`` of ``size`` bytes, checked against its SHA-256 (from the node's cache,
        or downloaded into it)."""

    def keep(self, sha256: str, body: bytes) -> None:
        """Put ``body`` (whose SHA-256 is ``sha256``) in the node's blob cache."""

    def checkpoint(self, header: UnitCheckpoint, body: bytes) -> None:
        """Upload one unit's state; returns once the hub holds it durably."""

    def report(self, report: StageReport) -> bool:
        """Post a report; the hub's Ack.ok (False: the generation is over)."""


@dataclass(frozen=True)
class StageOutcome:
    """How a stage's run ended (one of ``ENDINGS``), after how many steps, and why."""

    ended: str
    steps_done: int
    detail: str = ""


class TimedTransport:
    """The stage's transport, counting the seconds spent sending and waiting: a step's wall
    time less these is its compute."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.waited = 0.0

    def send(self, key: MessageKey, tensor: Tensor, sketch: bytes = b"") -> None:
        t0 = time.perf_counter()
        try:
            if sketch:
                self.inner.send(key, tensor, sketch)
            else:
                self.inner.send(key, tensor)
        finally:
            self.waited += time.perf_counter() - t0

    def receive(self, key: MessageKey, expected: TensorSpec, *, timeout_s: float) -> Tensor:
        t0 = time.perf_counter()
        try:
            return self.inner.receive(key, expected, timeout_s=timeout_s)
        finally:
            self.waited += time.perf_counter() - t0

    def expect(self, keys: Sequence[MessageKey]) -> None:
        """The receives the stage will make next, for a transport that asks for them ahead."""
        ahead = getattr(self.inner, "expect", None)
        if ahead is not None:
            ahead(keys)

    def flush(self) -> None:
        """Wait for the sends still on their way (a ``SendAhead``'s), counted as waiting."""
        if isinstance(self.inner, SendAhead):
            t0 = time.perf_counter()
            try:
                self.inner.flush()
            finally:
                self.waited += time.perf_counter() - t0


class StageWorker:
    """Runs ``assignment``'s stage: ``run()`` once, in a worker thread.

    ``transport``: how this stage meets the others (the relay with the assignment's generation);
    ``should_stop``: polled before each step (the node pausing or exiting); ``clock``: the hub's
    time, for the messages' timestamps; ``peer_timeout_s``: how long a neighbour's tensor may
    take, ``start_timeout_s`` in the first step (the other stages may still be downloading their
    state); ``on_step(steps_done, loss)`` after each step (loss on the last stage only);
    ``compute_share``: the node's ``--compute-share`` (node/computeshare.py)."""

    def __init__(
        self,
        assignment: StageAssignment,
        *,
        hub: StageHub,
        transport: Transport,
        device: torch.device | None = None,
        should_stop: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.time,
        peer_timeout_s: float = 60.0,
        start_timeout_s: float = 300.0,
        on_step: Callable[[int, float | None], None] | None = None,
        compute_share: float = 1.0,
    ) -> None:
        self.a = assignment
        self.hub = hub
        self.transport = TimedTransport(transport)
        self.device = device or torch.device("cpu")
        self.pace = ComputeShare(compute_share, self.device)
        self.should_stop = should_stop or (lambda: False)
        self.clock = clock
        self.peer_timeout_s = peer_timeout_s
        self.start_timeout_s = start_timeout_s
        self.on_step = on_step
        self.steps_done = assignment.first_step
        self.runner: StageRunner | None = None
        #: the fixed seconds per unit and micro-batch the stage measured before its first step
        self.unit_overhead_s = 0.0
        self._poster: ThreadPoolExecutor | None = None  # posts the reports, in order
        self._pending: Future[bool] | None = None  # the last step's report, on its way
        self._x: Tensor | None = None
        self._y: Tensor | None = None
        self._states: list[UnitTensors] = []
        try:
            self.place: LanePlace = lane_place(
                assignment.stage_starts, assignment.lanes, assignment.stage
            )
        except ValueError:  # prepare() refuses it
            self.place = LanePlace(tuple(assignment.stage_starts), 0, assignment.stage)

    @property
    def counts(self) -> tuple[int, ...]:
        """Each pipeline's micro-batches in a step."""
        return lane_counts(self.a.micro_batches, self.a.lanes, self.a.lane_micro_batches)

    @property
    def first(self) -> bool:
        return self.place.stage == 0

    @property
    def last(self) -> bool:
        return self.place.stage == self.place.stages - 1

    # ------------------------------------------------------------------ the run

    def run(self) -> StageOutcome:
        """Prepare the stage and run its steps; how it ended. Never raises a NodeError."""
        with ThreadPoolExecutor(1, thread_name_prefix="gpuflex-stage-report") as poster:
            self._poster = poster
            try:
                return self._run()
            finally:
                self._settle()
                self._poster = None

    def _run(self) -> StageOutcome:
        try:
            self.prepare()
            for step in range(self.a.first_step, self.a.end_step):
                if self.should_stop():
                    self._tell_failed("stopped: the node is pausing or exiting")
                    return StageOutcome(
                        "stopped", self.steps_done, "the node is pausing or exiting"
                    )
                # the last step's Ack may already say the job is done: the stage is done too
                if not self._step(step) and self.steps_done < self.a.end_step:
                    return StageOutcome("over", self.steps_done, "the hub ended this generation")
        except StaleGeneration as exc:
            return StageOutcome("stale", self.steps_done, str(exc))
        except PipelineError as exc:
            self._tell_failed(str(exc))
            return StageOutcome("failed", self.steps_done, str(exc))
        except Exception as exc:  # a bug: the hub re-plans without this node rather than wait
            log.exception("pipeline stage %d of job %s", self.a.stage, self.a.job_id)
            why = f"node error: {type(exc).__name__}: {exc}"
            self._tell_failed(why)
            return StageOutcome("failed", self.steps_done, " ".join(why.split())[:300])
        return StageOutcome("done", self.steps_done)

    def _step(self, step: int) -> bool:
        """Train step ``step``, checkpoint when due, report; False when the hub says stop."""
        runner = self.runner
        if runner is None:
            raise PipelineError("the stage was not prepared")
        inputs, targets = self.step_data(step)
        first = step == self.a.first_step
        runner.timeout_s = self.start_timeout_s if first else self.peer_timeout_s
        self.transport.waited = 0.0
        done = step + 1
        if done < self.a.end_step:
            # the next step's tensors asked for behind this step's (a prefetch asks in order),
            # so the stage keeps relay GETs parked through its whole step, its update and its
            # report included: the hub learns at once when their connections close
            self.transport.expect(runner.receives(step, self.a.micro_batches))
            self.transport.expect(runner.receives(done, self.a.micro_batches))
        t0 = time.perf_counter()
        loss = runner.run_step(step, self.a.micro_batches, inputs=inputs, targets=targets)
        if not self._answered():  # the hub ended the generation at the step before: not counted
            return False
        due = done % self.a.checkpoint_every == 0 or done == self.a.end_step
        if due:  # what the stage sent is delivered before its state is stored or its run ends
            self.transport.flush()
        # otherwise the next step starts while the last tensors are on their way (the tied
        # gradients at a step's end): a send that fails is raised by the next send or receive
        step_s = time.perf_counter() - t0
        if loss is not None and not math.isfinite(loss):
            raise PipelineError(f"the loss of step {step} is {loss}: training diverged")
        self.steps_done = done
        # every pipeline holds the same state after a step: the first pipeline's is stored
        if due and self.place.lane == 0:
            self.checkpoint(done)
        if self.on_step is not None:
            self.on_step(done, loss)
        compute_s = max(step_s - self.transport.waited, 0.0)
        report = self._report(step_s, compute_s, loss, update_s=runner.update_s)
        if done == self.a.end_step or self._poster is None:
            return self.hub.report(report)
        self._pending = self._poster.submit(self.hub.report, report)
        return True

    def _answered(self) -> bool:
        """The hub's answer to the report on its way (True when none is): its Ack.ok, or what
        it raised."""
        pending, self._pending = self._pending, None
        return True if pending is None else pending.result()

    def _settle(self) -> None:
        """Wait for the report on its way, whatever its answer (the stage is ending)."""
        try:
            self._answered()
        except Exception as exc:  # the stage ends either way; its outcome says how
            log.debug("stage %d of job %s: its last report: %s", self.a.stage, self.a.job_id, exc)

    def _report(
        self,
        step_s: float,
        compute_s: float,
        loss: float | None,
        failed: str = "",
        *,
        update_s: float = 0.0,
    ) -> StageReport:
        return StageReport(
            job_id=self.a.job_id,
            generation=self.a.generation,
            stage=self.a.stage,
            steps_done=self.steps_done,
            step_s=min(step_s, 1e6),
            compute_s=min(compute_s, 1e6),
            update_s=min(update_s, compute_s, 1e6),
            unit_overhead_s=min(self.unit_overhead_s, 1e3),
            loss=loss,
            failed=" ".join(failed.split())[:200],
            timestamp=self.clock(),
            nonce=new_nonce(),
        )

    def _tell_failed(self, why: str) -> None:
        """Tell the hub the stage stopped (best effort: the hub also notices its silence)."""
        self._settle()  # after the report on its way, so the hub reads them in order
        try:
            self.hub.report(self._report(0.0, 0.0, None, failed=why or "stopped"))
        except NodeError:
            pass

    # ------------------------------------------------------------------ checkpoints

    def unit_states(self) -> list[dict[str, Tensor]]:
        """Each of the stage's units' blob state now (parameters, buffers, optimizer state)."""
        runner = self.runner
        if runner is None:
            raise PipelineError("the stage was not prepared")
        slots = runner.optimizer.state_slots()
        return [
            unit_blob_state(child, runner.optimizer, slots) for child in runner.module.children()
        ]

    def checkpoint(self, step: int) -> None:
        """Every unit's state after ``step`` steps: into the node's cache, then to the hub."""
        for offset, state in enumerate(self.unit_states()):
            body = encode_state(state)
            sha = sha256_hex(body)
            self.hub.keep(sha, body)
            self.hub.checkpoint(
                UnitCheckpoint(
                    job_id=self.a.job_id,
                    generation=self.a.generation,
                    stage=self.a.stage,
                    unit=self.a.unit_start + offset,
                    step=step,
                    sha256=sha,
                    size=len(body),
                    timestamp=self.clock(),
                    nonce=new_nonce(),
                ),
                body,
            )

    # ------------------------------------------------------------------ preparing the stage

    def prepare(self) -> None:
        """Build the runner and read the data; PipelineError when anything does not fit."""
        a = self.a
        try:
            spec = ModelSpec.from_dict(a.model_spec)
        except ProtocolError as exc:
            raise PipelineError(f"the stage's model spec is refused: {exc}") from None
        units = pipeline_units(spec)
        try:
            self.place = lane_place(a.stage_starts, a.lanes, a.stage)
        except ValueError as exc:
            raise PipelineError(f"the stage's plan is refused: {exc}") from None
        starts = list(self.place.starts)
        if not stage_starts_ok(starts, len(units)) or (a.unit_start, a.unit_end) != self._range(
            len(units)
        ):
            raise PipelineError(
                f"units {a.unit_start}-{a.unit_end - 1} are not stage {self.place.stage} of a "
                f"{len(units)}-unit model cut at {starts}"
            )
        prepare_device(self.device, a.train.precision)
        module = self._build(units)
        optimizer = make_optimizer([p for p in module.parameters() if p.requires_grad], a.train)
        load_optimizer_state(optimizer, module, self._states, first_unit=a.unit_start)
        specs = self._crossings(units, spec)
        stage = self.place.stage
        self.runner = StageRunner(
            module=module,
            stage=stage,
            stages=len(starts),
            transport=self.transport,
            optimizer=optimizer,
            inbound=specs[stage - 1] if not self.first else None,
            outbound=specs[stage] if not self.last else None,
            loss_fn=loss_for(spec, a.train) if self.last else None,
            schedule=a.schedule,
            tied=cross_stage_ties(units.tied, starts),
            timeout_s=self.peer_timeout_s,
            seed=a.seed,
            inbound_code=self._code(specs, stage - 1) if not self.first else None,
            outbound_code=self._code(specs, stage) if not self.last else None,
            lane=self.place.lane,
            lanes=a.lanes,
            batch_samples=a.batch_size,
            first_micro_batch=sum(self.counts[: self.place.lane]),
            pace=None if self.pace.full else self.pace,
            sketched=lambda step: checked_step(a, step),
        )
        if self.first or self.last:
            self._read_data(spec)
        self.unit_overhead_s = self._measure_overhead(module, spec, specs)

    def _measure_overhead(
        self, module: nn.Module, spec: ModelSpec, specs: Sequence[TensorSpec]
    ) -> float:
        """The stage's fixed seconds per unit and micro-batch (node/pipeline/overhead.py), on
        zeros of one micro-batch of its input; at a compute share below 1 the step rests in
        proportion to its compute, so the fixed time it reports grows with it. 0 when torch
        cannot run the measure (the stage itself then fails in its first step, saying why)."""
        if self.first:
            micro = self.a.batch_size // sum(self.counts)
            shape, dtype = (micro, *spec.input_shape), spec.input_dtype
        else:
            inbound = specs[self.place.stage - 1]
            shape, dtype = inbound.shape, getattr(torch, inbound.dtype)
        example = torch.zeros(shape, dtype=dtype, device=self.device)
        try:
            took = unit_overhead_s(module, example, units=self.a.unit_end - self.a.unit_start)
        except RuntimeError as exc:
            log.warning(
                "stage %d of job %s: its fixed time not measured: %s",
                self.a.stage,
                self.a.job_id,
                exc,
            )
            return 0.0
        return took / min(max(self.pace.share, 1e-3), 1.0)

    def _range(self, units: int) -> tuple[int, int]:
        bounds = [*self.place.starts, units]
        return bounds[self.place.stage], bounds[self.place.stage + 1]

    def _build(self, units: Units) -> nn.Sequential:
        a = self.a
        mine = units.units[a.unit_start : a.unit_end]
        if a.unit_states:
            by_unit = {s.unit: s for s in a.unit_states}
            if sorted(by_unit) != list(range(a.unit_start, a.unit_end)):
                raise PipelineError(
                    f"the assignment's unit states are for units {sorted(by_unit)}, the stage "
                    f"holds {a.unit_start}-{a.unit_end - 1}"
                )
            self._states = [
                read_unit_state(
                    unit,
                    self.hub.blob(by_unit[i].sha256, by_unit[i].size),
                    f"the state of unit {i}",
                )
                for i, unit in enumerate(mine, start=a.unit_start)
            ]
        else:
            model = self._decode(self.hub.blob(a.model_hash, a.model_size), "the job's model")
            self._states = [state_from_model(unit, model) for unit in mine]
        module = build_stage(
            mine, self._states, first_unit=a.unit_start, ties=units.tied, device=self.device
        )
        return module.train()

    def _crossings(self, units: Units, spec: ModelSpec) -> list[TensorSpec]:
        """What crosses each cut for one micro-batch: the stages run on the meta device."""
        bounds = [*self.place.starts, len(units)]
        stages = [
            copy.deepcopy(nn.Sequential(*(u.module for u in units.units[lo:hi]))).eval()
            for lo, hi in itertools.pairwise(bounds)
        ]
        micro = self.a.batch_size // sum(self.counts)
        example = torch.zeros((micro, *spec.input_shape), dtype=spec.input_dtype)
        return boundary_specs(stages, example)

    def _code(self, specs: Sequence[TensorSpec], cut: int) -> BoundaryCode | None:
        """How the tensors of cut ``cut`` travel (None: as they are, for "fp32")."""
        if self.a.boundary == "fp32":
            return None
        try:
            return BoundaryCode(
                self.a.boundary, self.a.boundary_rank, raw=specs[cut], seed=self.a.seed, cut=cut
            )
        except ProtocolError as exc:
            raise PipelineError(f"cut {cut} of the pipeline cannot travel so: {exc}") from None

    @staticmethod
    def _decode(data: Buffer, what: str) -> dict[str, Tensor]:
        try:
            return decode_state(data)
        except ProtocolError as exc:
            raise PipelineError(f"{what} is refused: {exc}") from None

    def _read_data(self, spec: ModelSpec) -> None:
        chunks = []
        for i, ref in enumerate(self.a.chunks):
            chunk = self._decode(self.hub.blob(ref.sha256, ref.size), f"chunk {i}")
            x = chunk.get("x")
            if x is None or int(x.shape[0]) != ref.samples:
                raise PipelineError(
                    f"chunk {i} does not hold the {ref.samples} samples it declares"
                )
            chunks.append(chunk)
        try:
            self._x, self._y = stack_chunks(spec, chunks)
        except NodeError as exc:
            raise PipelineError(f"the job's data does not fit its model: {exc}") from None

    def step_data(self, step: int) -> tuple[Sequence[Tensor], Sequence[Tensor]]:
        """Step ``step``'s micro-batches: inputs on the first stage, targets on the last."""
        if not (self.first or self.last):
            return (), ()
        if self._x is None or self._y is None:
            raise PipelineError(f"stage {self.a.stage} has no data")
        total = int(self._x.shape[0])
        index = torch.tensor(step_samples(self.a.seed, step, self.a.batch_size, total))
        a = self.a
        parts = [index[lo:hi] for lo, hi in lane_slices(a.batch_size, self.counts, self.place.lane)]
        inputs = [self._x[p].to(self.device) for p in parts] if self.first else []
        targets = [self._y[p].to(self.device) for p in parts] if self.last else []
        return inputs, targets


__all__ = ["ENDINGS", "StageHub", "StageOutcome", "StageWorker", "TimedTransport"]
