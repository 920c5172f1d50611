"""NodeAgent: the work loop. Register, take work, check it, fetch, train, upload, repeat.

One ``NodeAgent.run()`` is the whole running node: an ``asyncio.TaskGroup`` of the work
loop, the heartbeat loop, the local control endpoint and (on a GPU) the GPU-yield watcher.
Nothing here is a process-wide singleton; tests build as many agents as they like, one
per data dir at a time (the data dir is locked while an agent holds it).

The concerns around the loop live in their own modules, none of which imports this one:

    pause.py         the pause/resume state machine; what a pause or an exit interrupts
    signals.py       SIGINT/SIGTERM -> a clean exit; a second Ctrl-C leaves at once
    registration.py  the hub key check (pin) and the signed hello
    assignment.py    the node's own checks on a signed assignment; reading its inputs
    transfers.py     downloads checked by sha256, the upload with retries and re-signing
    control.py       the local control endpoint (status, pause, resume)
    gpuyield.py      pausing while another process uses the GPU
    computeshare.py  --compute-share: resting after each piece of training; the speed offered
    datadir.py       the data dir's lock (one node per folder)
    silos.py         node-local data: a chunk that is one of this node's silos is read from its disk
    totals.py        the counters and their file

Test tooling builds misbehaving contributors by overriding three methods (contract):

* ``train(assignment, chunks, global_state) -> TrainResult`` (runs in a worker thread)
* ``transform_update(assignment, result) -> TrainResult`` (identity here)
* ``encode_update(assignment, result, residual) -> Encoded`` (the job's update encoding with
  its error feedback, protocol/encoding.py)

Trust rules: the hub key is pinned before anything else; every assignment's signature
and fields are checked before a byte is downloaded; a work answer signed by any other key
stops the node (someone is forging the hub); every blob is size-capped and hash-checked;
the model comes only from the declarative spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch
from gpuflex.protocol.compute import class_key
from gpuflex.protocol.encoding import Encoded
from gpuflex.protocol.messages import (
    Assignment,
    Benchmark,
    ComputeClass,
    NoWork,
    StageAssignment,
    StateRequest,
    progress_digest,
)
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.signing import SigningKey, fingerprint
from gpuflex.protocol.version import SOFTWARE_VERSION
from torch import Tensor

from .assignment import check_assignment
from .assignment_run import AssignmentRun, Current
from .cache import BlobCache
from .checkpoints import CheckpointStore
from .client import Backoff, HubClient, json_error_detail
from .computeshare import ComputeShare, check_share, offered
from .control import ControlServer
from .datadir import DataDirLock
from .device import apply_limits, compute_class, offered_memory, select_device, set_onednn
from .devices import WorkerGroup, batch_statistics, worker_group
from .errors import (
    AssignmentRejected,
    BadSignature,
    Banned,
    BlobError,
    ConfigError,
    HubError,
    HubForged,
    HubKeyMismatch,
    HubUnavailable,
    NodeError,
    RemovedSilo,
    TrainError,
    TrainingStopped,
    UnknownNode,
    WorkersLost,
)
from .feedback import FeedbackStore
from .gpuyield import yield_gpu_while_busy
from .handback import HandBack
from .handover import hand_over
from .heartbeat import heartbeat_loop
from .identity import PIN_FILE, load_or_create_key
from .output import Output
from .pause import Interrupted, PauseState
from .registration import probe_link, register
from .signals import EXIT_SECOND_INTERRUPT, exit_on_signals
from .silos import SiloError, SiloStore
from .stagework import take_stage
from .totals import Totals, TotalsFile
from .trainer import TrainResult, train_assignment
from .transfers import Transfers

log = logging.getLogger(__name__)

EXIT_KEY_MISMATCH = 3
EXIT_BANNED = 4
EXIT_VERSION_MISMATCH = 5


@dataclass
class NodeConfig:
    hub_url: str
    data_dir: Path
    hub_key: str | None = None
    device: str = "auto"
    max_cache_bytes: int = 20 << 30
    threads: int | None = None
    max_gpu_memory_gb: float | None = None
    #: the memory offered to a pipeline stage (--max-memory); None: what the device has free
    max_memory_bytes: int | None = None
    #: "host:port" where this node takes other stages' tensors directly (--stage-listen; "": none)
    stage_address: str = ""
    once: bool = False
    max_assignments: int | None = None
    poll_wait_s: float = 30.0
    heartbeat_s: float = 5.0
    yield_gpu: bool = True
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    abandon_timeout_s: float = 3.0
    control: bool = True
    benchmark: Benchmark | None = None  # None: cached or quick measurement at start
    onednn: bool = True  # --onednn off: torch's oneDNN CPU kernels off (another compute class)
    precisions: tuple[str, ...] | None = None  # --precisions: the subset of the device's to offer
    bench_cache: Path | None = None  # shared benchmark cache file (default DIR/bench.json)
    enroll_token: str = ""  # the operator's enrollment token, when the hub asks for one
    source_address: str | None = None  # bind outgoing connections to this local address
    #: checkpoint states kept for the hub's referee (node/checkpoints.py: every assignment of the
    #: job's two newest rounds, within this many bytes in all)
    max_checkpoint_bytes: int = 2 << 30
    #: --devices: train on several local devices, one worker process each (node/devices); None: ``device``
    devices: str | None = None
    offload: str | None = None  # --offload optimizer: the optimizer state in host memory
    worker_restarts: int = 1  # fresh workers for an assignment whose worker process died, then hand it back
    #: --compute-share: the share of its wall time the node computes (node/computeshare.py)
    compute_share: float = 1.0


class NodeAgent:
    """The running node. Override ``train`` / ``transform_update`` to misbehave on purpose."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        output: Output | None = None,
        key: SigningKey | None = None,
    ) -> None:
        if not config.hub_url.startswith(("http://", "https://")):
            raise ConfigError(f"--hub {config.hub_url!r}: expected an http:// or https:// URL")
        self.config = config
        self.output = output or Output()
        # The data dir holds the key, the job's data and the control token: owner only.
        config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One node per data dir, taken before the key or the cache is touched; run() frees it.
        self.lock = DataDirLock(config.data_dir).acquire()
        try:
            self.compute_share = check_share(config.compute_share)
            self.device = select_device(config.device) if config.devices is None else torch.device("cpu")
            apply_limits(self.device, threads=config.threads, max_gpu_memory_gb=config.max_gpu_memory_gb)
            self.workers: WorkerGroup | None = None  # the node's devices, when it trains on several
            if config.devices is not None:
                self.device, self.workers = worker_group(
                    config.devices, offload=config.offload, work_dir=config.data_dir / "devices",
                    max_memory_bytes=config.max_memory_bytes, threads=torch.get_num_threads(),
                    restarts=config.worker_restarts, compute_share=config.compute_share,
                    on_event=self.output.event)
            self.key = key or load_or_create_key(config.data_dir)
            set_onednn(config.onednn)
            self.compute: ComputeClass = compute_class(self.device, precisions=config.precisions)
            if not self.compute.precisions:
                raise ConfigError(f"--precisions {','.join(config.precisions or ())}: this {self.device.type} "
                                  "device trains none of them")
            self.cache = BlobCache(config.data_dir / "cache", config.max_cache_bytes)
            self.checkpoints = CheckpointStore(config.data_dir / "checkpoints", max_bytes=config.max_checkpoint_bytes)
            self.feedback = FeedbackStore(config.data_dir / "feedback")
            # node-local data (`gpuflex-node data add`, another process): read again for every assignment
            self.silos = SiloStore(config.data_dir / "silos")
        except BaseException:
            self.lock.release()
            raise
        self.node_id = self.key.fingerprint
        self.pause_state = PauseState(self.output)
        self.totals_file = TotalsFile(config.data_dir)
        self.transfers = Transfers(
            self.cache, self.totals, self.output, self.pause_state,
            backoff_base_s=config.backoff_base_s, backoff_cap_s=config.backoff_cap_s,
        )
        self.client: HubClient | None = None
        self.registered = False
        self.state = "starting"
        self.current: Current | None = None
        self.last_samples_per_s = 0.0
        self.exit_code = 0
        self.fatal: NodeError | None = None
        self.done_assignments = 0
        self.seen_assignments: set[str] = set()  # uploaded or refused: the same one again is a replay
        self.seen_stages: set[tuple[str, int, int]] = set()  # (job, generation, stage) run: the same again is a replay
        self.stage_in_hand: StageAssignment | None = None
        self._handed_over: set[str] = set()  # state requests answered (the referee's, node/checkpoints.py)
        self.handback = HandBack(self._client, self.output, lambda: self.totals,
                                 timeout_s=config.abandon_timeout_s)
        self._let_go = asyncio.Event()  # set while no assignment is in hand
        self._let_go.set()
        self._benchmark_msg: Benchmark | None = None

    # ---------------------------------------------------------------- overridable steps

    def train(
        self,
        assignment: Assignment,
        chunks: Sequence[Mapping[str, Tensor]],
        global_state: Mapping[str, Tensor],
    ) -> TrainResult:
        """Train one assignment (called in a worker thread)."""
        cur = self.current
        spec = cur.spec if cur is not None else ModelSpec.from_dict(assignment.model_spec)

        def progress(fraction: float) -> None:
            if cur is not None:
                cur.progress = fraction
            self.output.progress_update(fraction)

        def on_loss(step: int, loss: float) -> None:
            if cur is not None:
                cur.digest = progress_digest(cur.digest, step, loss)
                cur.steps = step

        if self.workers is not None and not batch_statistics(global_state):
            try:
                return self.workers.train_assignment(
                    assignment, spec, chunks, global_state, checkpoints=self.checkpoints,
                    feedback=cur.residual if cur is not None else None, progress=progress,
                    should_stop=self.stop_training.is_set, on_loss=on_loss)
            except WorkersLost as exc:
                if cur is not None:
                    cur.stop_reason = str(exc)[:200]
                raise
        pace = ComputeShare(self.compute_share, self.device)
        if not assignment.train.commit:  # the job never asks the referee: no checkpoint to pay for
            return train_assignment(
                spec, global_state, chunks, assignment.train, assignment.seed,
                device=self.device, progress=progress, should_stop=self.stop_training.is_set, on_loss=on_loss,
                pace=pace,
            )
        n = sum(int(c["x"].shape[0]) for c in chunks)
        recorder = self.checkpoints.recorder(assignment, n, feedback=cur.residual if cur is not None else None)
        try:
            result = train_assignment(
                spec, global_state, chunks, assignment.train, assignment.seed,
                device=self.device, progress=progress, should_stop=self.stop_training.is_set,
                on_step=recorder, on_loss=on_loss, pace=pace,
            )
        except BaseException:
            recorder.abandon()
            raise
        return dataclasses.replace(result, commitment=recorder.commitment())

    async def hand_over(self, asked: StateRequest) -> None:
        """Answer the hub's referee: the committed states it asked for, or at once which are no
        longer kept (node/handover.py)."""
        await hand_over(self._client(), self.checkpoints, self.output, asked)

    def transform_update(self, assignment: Assignment, result: TrainResult) -> TrainResult:
        """The step between training and upload; identity in the shipped node."""
        return result

    def encode_update(self, assignment: Assignment, result: TrainResult,
                      residual: Mapping[str, Tensor] | None) -> Encoded:
        """The update as it travels: the job's encoding of the dense delta plus the residual
        (worker thread)."""
        return assignment.train.encoding.encode(result.delta, residual)

    # ---------------------------------------------------------------- state others read

    @property
    def totals(self) -> Totals:
        return self.totals_file.totals

    @property
    def paused(self) -> bool:
        return self.pause_state.paused

    @property
    def pause_reason(self) -> str:
        return self.pause_state.reason

    @property
    def stop_training(self) -> threading.Event:
        """The thread-safe flag training polls between batches."""
        return self.pause_state.stop_training

    @property
    def hub_fingerprint(self) -> str:
        pinned = self.client.hub_public_key if self.client is not None else None
        return fingerprint(pinned) if pinned else ""

    # ---------------------------------------------------------------- control surface

    def status(self) -> dict[str, Any]:
        cur = self.current
        assignment = None
        if cur is not None:
            a = cur.assignment
            assignment = {
                "assignment_id": a.assignment_id, "job_id": a.job_id, "round": a.round,
                "phase": cur.phase, "progress": round(cur.progress, 4), "chunks": len(a.chunks),
                "samples": cur.samples, "deadline": cur.deadline,
                "precision": a.train.precision,
            }
        return {
            "node_id": self.node_id,
            "version": SOFTWARE_VERSION,
            "hub": self.config.hub_url,
            "hub_fingerprint": self.hub_fingerprint,
            "registered": self.registered,
            "state": self.state,
            "paused": self.paused,
            "pause_reason": self.pause_reason,
            "device": str(self.device),
            "compute_class": {
                "device_kind": self.compute.device_kind, "device_model": self.compute.device_model,
                "capability": self.compute.capability, "cpu_vendor": self.compute.cpu_vendor,
                "isa": list(self.compute.isa), "torch": self.compute.torch_version,
                "cuda": self.compute.cuda_version, "cudnn": self.compute.cudnn_version,
                "onednn": self.compute.onednn, "threads": self.compute.threads,
                "precisions": list(self.compute.precisions),
            },
            "class_keys": {p: class_key(self.compute, p) for p in self.compute.precisions},
            "assignment": assignment,
            "stage": _stage_status(self.stage_in_hand),
            "samples_per_s": round(self.last_samples_per_s, 2),
            "compute_share": self.compute_share,
            "cache_bytes": self.cache.size_bytes(),
            "cache_cap_bytes": self.cache.max_bytes,
            "totals": self.totals.as_dict(),
        }

    def pause(self, reason: str = "user") -> bool:
        """Stop taking work; abandon the assignment in hand (the hub is told at once)."""
        return self.pause_state.pause(reason)

    async def pause_and_report(self, reason: str = "user") -> dict[str, Any]:
        """``pause``, then what it did to the assignment in hand, for `gpuflex-node pause` to say:
        ``assignment`` is None when nothing was in hand, else its id and ``outcome``: handed_back
        (the hub was told), not_told (abandoned; the hub could not be reached), ended (it finished
        before the pause reached it) or pending (still being handed back when the wait ran out)."""
        cur = self.current
        held = cur.assignment.assignment_id if cur is not None else None
        changed = self.pause_state.pause(reason)
        result: dict[str, Any] = {"paused": True, "changed": changed, "assignment": None}
        if not changed or held is None:
            return result
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.abandon_timeout_s + 2.0):
                await self._let_go.wait()
        if (cur := self.current) is not None and cur.assignment.assignment_id == held:
            outcome = "pending"
        elif held in self.handback.told:
            outcome = "handed_back" if self.handback.told[held] else "not_told"
        else:
            outcome = "ended"
        result["assignment"] = {"assignment_id": held, "outcome": outcome}
        return result

    def resume(self) -> bool:
        return self.pause_state.resume()

    def request_exit(self, reason: str = "signal") -> None:
        self.pause_state.request_exit(reason)

    # ---------------------------------------------------------------- main

    async def run(self) -> int:
        """Run until --once / --max-assignments is satisfied, a signal, or a fatal error."""
        try:
            with exit_on_signals(
                self.request_exit,
                lambda: self.pause_state.exiting,
                lambda: self.output.event(
                    "exit", code=EXIT_SECOND_INTERRUPT, detail="second interrupt: leaving at once"
                ),
            ):
                await self._run()
        finally:
            self.output.progress_stop()
            self.totals_file.save(force=True)
            self.lock.release()
        self.output.event("exit", code=self.exit_code)
        return self.exit_code

    async def _run(self) -> None:
        self.output.event(
            "starting", node_id=self.node_id, hub=self.config.hub_url, data_dir=str(self.config.data_dir),
            device=str(self.device), threads=torch.get_num_threads(), version=SOFTWARE_VERSION,
            onednn=self.compute.onednn, precisions=list(self.compute.precisions),
        )
        with contextlib.suppress(OSError, SiloError):  # replaced silos no assignment is in flight for
            await asyncio.to_thread(self.silos.prune)
        benchmark = self.config.benchmark or await asyncio.to_thread(
            _registration_benchmark, self.config, self.device, self.output, self.workers)
        benchmark = offered(benchmark, self.compute_share)  # the node as it will run
        local = (self.config.source_address, 0) if self.config.source_address else None
        connector = aiohttp.TCPConnector(limit=8, local_addr=local)

        async def work_then_exit() -> None:  # the node exits when the work loop ends
            try:
                await self._work_loop(benchmark)
            finally:
                self.request_exit("done")

        async with aiohttp.ClientSession(connector=connector) as session:
            self.client = HubClient(self.config.hub_url, self.key, session)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(work_then_exit())
                tg.create_task(heartbeat_loop(self, self.config.heartbeat_s))
                if self.config.control:
                    control = ControlServer(self, self.config.data_dir, self.output)
                    tg.create_task(control.serve(self.pause_state.exited))
                if self.config.yield_gpu and self.device.type == "cuda":
                    tg.create_task(yield_gpu_while_busy(self.pause_state, self.device, self.output))

    def _stop(self, exc: NodeError, code: int) -> None:
        """A fatal error: say it loudly, leave with ``code``."""
        self.fatal = exc
        self.output.event("error", fatal=True, **json_error_detail(exc))
        self.exit_code = code

    async def _work_loop(self, benchmark: Benchmark) -> None:
        pause = self.pause_state
        backoff = Backoff(self.config.backoff_base_s, self.config.backoff_cap_s)
        while not pause.exiting:
            if pause.paused:
                self.state = "paused"
                await pause.resumed.wait()
                continue
            try:
                if not self.registered:
                    self.state = "connecting"
                    await pause.interruptible(self._connect(benchmark))
                self.state = "waiting"
                client = self._client()
                item, inline = await pause.interruptible(
                    client.request_work(self.config.poll_wait_s, self.cache.ids(4096))
                )
                if isinstance(item, StateRequest):
                    backoff.reset()
                    if item.request_id in self._handed_over:
                        # asked again: what it lacks is not kept here; wait rather than spin until its deadline
                        await pause.sleep(min(5.0, max(0.5, item.deadline - time.time())))
                        continue
                    await pause.interruptible(self.hand_over(item))
                    self._handed_over.add(item.request_id)  # after a failure it is answered again
                    continue
                if isinstance(item, NoWork):
                    backoff.reset()
                    self.output.event("no_work", reason=item.reason, retry_after_s=item.retry_after_s)
                    await pause.sleep(min(item.retry_after_s, 30.0))
                    continue
                backoff.reset()
                handled = (take_stage(self, item) if isinstance(item, StageAssignment)
                           else self._handle(item, inline_model=inline))
                if not await handled:
                    continue  # abandoned (pause, re-registration, hub error): not a finished one
                self.done_assignments += 1
                if self.config.once or (
                    self.config.max_assignments is not None
                    and self.done_assignments >= self.config.max_assignments
                ):
                    return
            except Interrupted:
                continue
            except (HubKeyMismatch, Banned) as exc:
                self._stop(exc, EXIT_KEY_MISMATCH if isinstance(exc, HubKeyMismatch) else EXIT_BANNED)
                return
            except BadSignature as exc:
                # It came from the hub's address, yet the pinned key did not sign it: retrying
                # cannot help, and the volunteer must hear it, as for a changed hub key.
                self.totals.rejected += 1
                self._stop(_forged(exc, self.config, self.hub_fingerprint), EXIT_KEY_MISMATCH)
                return
            except UnknownNode as exc:
                self.registered = False
                self.output.event("error", **json_error_detail(exc), action="re-register")
                await pause.sleep(backoff.next_delay())
            except HubUnavailable as exc:
                self.state = "backoff"
                delay = backoff.next_delay()
                self.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
                await pause.sleep(delay)
            except AssignmentRejected as exc:
                self.totals.rejected += 1
                self.output.event("rejected", **json_error_detail(exc))
                await pause.sleep(backoff.next_delay())
            except HubError as exc:
                if exc.code == "version_mismatch":
                    self._stop(exc, EXIT_VERSION_MISMATCH)
                    return
                if exc.code == "bad_answer":
                    self.registered = False  # re-check the hub's key before trusting it again
                delay = backoff.next_delay()
                self.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
                await pause.sleep(delay)
            except Exception as exc:  # a bug must not end a volunteer's node: log, back off, go on
                log.exception("unexpected error in the work loop")
                delay = backoff.next_delay()
                self.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
                await pause.sleep(delay)

    def _client(self) -> HubClient:
        if self.client is None:
            raise HubUnavailable("no hub client")
        return self.client

    async def _connect(self, benchmark: Benchmark) -> None:
        pin = await register(
            self._client(), data_dir=self.config.data_dir, hub_url=self.config.hub_url,
            expected_hub_key=self.config.hub_key, node_id=self.node_id, device=self.device,
            benchmark=benchmark, compute=self.compute, enroll_token=self.config.enroll_token,
            max_memory_bytes=offered_memory(self.device, self.config.max_memory_bytes),
            stage_address=self.config.stage_address,
        )
        self.registered = True
        self._benchmark_msg = benchmark
        self.output.event(
            "registered", node_id=self.node_id, hub=self.config.hub_url,
            hub_fingerprint=pin.fingerprint, device=str(self.device),
            samples_per_s=round(benchmark.samples_per_s, 1),
        )
        try:  # the hub times this node's uplink; a hub that cannot, or a failed probe, changes nothing
            ack = await probe_link(self._client())
            self.output.event("note", detail=f"link probe: {ack.detail[:200]}")
        except (NodeError, aiohttp.ClientError, TimeoutError) as exc:
            self.output.event("note", detail=f"link probe not timed: {str(exc)[:200]}")

    async def _reregister(self) -> bool:
        """The hub forgot this node: register again (False before a first registration)."""
        self.registered = False
        if self._benchmark_msg is None:
            return False
        await self._connect(self._benchmark_msg)
        return True

    # ---------------------------------------------------------------- one assignment

    def check_assignment(self, a: Assignment, local: frozenset[str] = frozenset()) -> ModelSpec:
        """Field checks beyond the protocol's own; raises AssignmentRejected. ``local``: the
        chunks that are this node's silos (``silo_chunks``)."""
        return check_assignment(
            a, node_id=self.node_id, now=self._client().now(), seen=self.seen_assignments,
            cache_cap_bytes=self.cache.max_bytes, precisions=self.compute.precisions, local=local,
        )

    def silo_chunks(self, a: Assignment) -> frozenset[str]:
        """The assignment's chunks that are this node's silos, from the silo store as it is now
        (the operator may have run ``gpuflex-node data add`` since the last one). A chunk that
        was a silo the operator removed is refused here: it is on no hub to download."""
        held = self.silos.blob_ids()
        local = frozenset(c.sha256 for c in a.chunks if c.sha256 in held)
        try:
            retired = self.silos.retired()
        except SiloError as exc:
            log.warning("silo index unreadable: %s", exc)
            retired = {}
        for c in a.chunks:
            job = retired.get(c.sha256)
            if job is not None and c.sha256 not in local:
                raise RemovedSilo(
                    f"assignment {a.assignment_id}: chunk {c.sha256[:12]}… is the silo of job {job} that was "
                    "removed from this node (gpuflex-node data remove); not trained",
                    job_id=job, sha256=c.sha256,
                )
        return local

    async def _handle(self, a: Assignment, *, inline_model: bytes | None = None) -> bool:
        """Work one assignment; True when it ran to an end (uploaded or refused), False if abandoned.

        ``inline_model``: the model's bytes when the hub sent them with the assignment.
        """
        pause = self.pause_state
        self.totals.assignments += 1
        try:
            local = self.silo_chunks(a)
            spec = self.check_assignment(a, local)
        except AssignmentRejected as exc:
            if a.node_id == self.node_id:
                # a removed silo the hub still assigns (it was not told at `data remove`): withdrawn,
                # so no later round assigns it or waits for it (the abandon is then a no-op)
                if isinstance(exc, RemovedSilo):
                    await self.handback.tell_withdrawn(exc.job_id, exc.sha256)
                await self.handback.tell_abandon(a.assignment_id, f"rejected: {exc}"[:256])
            raise
        pause.new_assignment()
        cur = Current(assignment=a, spec=spec, deadline=a.deadline)
        cur.samples = sum(c.samples for c in a.chunks)
        self.current = cur
        self._let_go.clear()
        self.output.event(
            "assignment", assignment_id=a.assignment_id, job_id=a.job_id, round=a.round,
            chunks=len(a.chunks), samples=cur.samples, **({"silo_chunks": len(local)} if local else {}),
        )
        try:
            return await AssignmentRun(self, a, spec, local, cur).run(inline_model)
        except TrainingStopped:
            reason = cur.stop_reason or ("paused" if self.paused else "shutting down")
            await self.handback.abandon(a, reason)
        except Interrupted:
            reason = "paused" if self.paused else "shutting down"
            await self.handback.abandon(a, reason)
            raise
        except (TrainError, BlobError) as exc:
            self.output.event("rejected", assignment_id=a.assignment_id, **json_error_detail(exc))
            self.totals.rejected += 1
            await self.handback.tell_abandon(a.assignment_id, f"rejected: {exc}"[:256])
            return True
        except UnknownNode as exc:
            # The hub forgot us mid-assignment: register again, then hand the assignment back
            # so its shard is free at once (rather than when its deadline passes).
            self.registered = False
            if self._benchmark_msg is None:
                raise
            self.output.event("error", assignment_id=a.assignment_id, **json_error_detail(exc),
                              action="re-register")
            await pause.interruptible(self._connect(self._benchmark_msg))
            await self.handback.abandon(a, "node re-registered")
        except HubError as exc:
            self.output.event("error", assignment_id=a.assignment_id, **json_error_detail(exc))
            await self.handback.abandon(a, f"hub error: {exc.code or exc.status}")
        except (HubUnavailable, AssignmentRejected):
            raise
        except Exception as exc:
            await self.handback.abandon(a, f"node error: {type(exc).__name__}")
            raise
        finally:
            self.current = None
            self._let_go.set()
            self.totals_file.save()
            with contextlib.suppress(OSError):
                self.cache.evict()
            if local:  # a replaced silo's blob served its last assignment
                with contextlib.suppress(OSError, SiloError):
                    self.silos.prune()
        return False


def _stage_status(a: StageAssignment | None) -> dict[str, Any] | None:
    if a is None:
        return None
    return {"job_id": a.job_id, "generation": a.generation, "stage": a.stage, "stages": len(a.stage_starts),
            "units": [a.unit_start, a.unit_end - 1], "steps": [a.first_step, a.end_step - 1]}


def _registration_benchmark(config: NodeConfig, device: torch.device, output: Output,
                            workers: WorkerGroup | None) -> Benchmark:
    """The benchmark the hello carries: cached per machine, measured once (worker thread); a node
    on several devices is measured whole, through its workers."""
    from .benchcache import cache_path
    from .benchmark import benchmark_for_registration

    path = cache_path(config.data_dir, config.bench_cache)
    how = "a second or two" if workers is None else f"a few seconds: {workers.plan.workers} worker processes"
    return benchmark_for_registration(
        device, path, group=workers,
        on_measure=lambda: output.event("benchmark", detail=f"measuring this machine once ({how}); cached in {path}"),
    )


def _forged(exc: BadSignature, config: NodeConfig, hub_fingerprint: str) -> HubForged:
    """A work answer the pinned key did not sign: the node stops, and says why loudly."""
    where = "given with --hub-key" if config.hub_key else f"pinned in {config.data_dir / PIN_FILE}"
    log.warning("forged work answer: %s", exc)
    return HubForged(
        f"REFUSING TO WORK: someone is forging the hub. Work from the hub at "
        f"{config.hub_url} is not signed by the hub key this node trusts, "
        f"{hub_fingerprint or '(none)'} ({where}). Nothing was downloaded or trained. "
        f"Tell the hub operator, and start this node again once the hub is trustworthy."
    )


__all__ = ["Current", "NodeAgent", "NodeConfig", "Totals"]
