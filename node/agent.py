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
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
from gpuflex.protocol.checkpoint import auto_every
from gpuflex.protocol.compute import class_key
from gpuflex.protocol.encoding import Encoded
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import (
    Assignment,
    Benchmark,
    ComputeClass,
    NoWork,
    StateRequest,
    StateUnavailable,
    StateUpload,
    progress_digest,
)
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.signing import SigningKey, fingerprint, new_nonce
from gpuflex.protocol.tensors import check_finite
from gpuflex.protocol.version import SOFTWARE_VERSION
from gpuflex.protocol.workload import assignment_steps, samples_processed
from torch import Tensor

from . import secagg_flow
from .assignment import check_assignment, load_inputs
from .cache import BlobCache
from .checkpoints import CheckpointRecorder, CheckpointStore
from .client import Backoff, HubClient, json_error_detail
from .control import ControlServer
from .datadir import DataDirLock
from .device import apply_limits, compute_class, select_device, set_onednn
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
)
from .feedback import FeedbackStore
from .gpuyield import yield_gpu_while_busy
from .identity import PIN_FILE, load_or_create_key
from .output import Output
from .pause import Interrupted, PauseState
from .registration import register
from .signals import EXIT_SECOND_INTERRUPT, exit_on_signals
from .silos import SiloError, SiloStore
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


@dataclass
class Current:
    """The assignment in hand, as the status endpoint shows it."""

    assignment: Assignment
    spec: ModelSpec
    phase: str = "verifying"  # verifying|downloading|training|uploading
    progress: float = 0.0
    steps: int = 0  # optimizer steps so far, and the running digest over them (heartbeats prove progress)
    digest: bytes = bytes(32)
    deadline: float = 0.0
    samples: int = 0
    started: float = field(default_factory=time.time)
    stop_reason: str = ""
    #: error feedback's residual this update adds (node/feedback.py); the last checkpoint commits it
    residual: dict[str, Tensor] | None = None


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
            self.key = key or load_or_create_key(config.data_dir)
            self.device = select_device(config.device)
            apply_limits(self.device, threads=config.threads, max_gpu_memory_gb=config.max_gpu_memory_gb)
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
        self._seen_assignments: set[str] = set()
        self._handed_over: set[str] = set()  # state requests answered (the referee's, node/checkpoints.py)
        self._abandoned: dict[str, bool] = {}  # the latest abandoned assignments: was the hub told?
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

        if not assignment.train.commit:  # the job never asks the referee: no checkpoint to pay for
            return train_assignment(
                spec, global_state, chunks, assignment.train, assignment.seed,
                device=self.device, progress=progress, should_stop=self.stop_training.is_set, on_loss=on_loss,
            )
        n = sum(int(c["x"].shape[0]) for c in chunks)
        t = assignment.train
        total = assignment_steps(n, t.batch_size, t.local_epochs, t.local_steps)
        every = auto_every(total, assignment.train.checkpoint_every)
        cur = self.current
        recorder = CheckpointRecorder(total_steps=total, every=every, precision=assignment.train.precision,
                                      store=self.checkpoints, assignment_id=assignment.assignment_id,
                                      feedback=cur.residual if cur is not None else None)
        self.checkpoints.begin(assignment.assignment_id, assignment.job_id, assignment.round)
        dropped = self.checkpoints.prune(keep_id=assignment.assignment_id, job_id=assignment.job_id,
                                         round=assignment.round)
        if dropped:
            log.debug("checkpoint states dropped: %s", dropped)
        try:
            result = train_assignment(
                spec, global_state, chunks, assignment.train, assignment.seed,
                device=self.device, progress=progress, should_stop=self.stop_training.is_set,
                on_step=recorder, on_loss=on_loss,
            )
        except BaseException:
            recorder.abandon()
            raise
        return dataclasses.replace(result, commitment=recorder.commitment())

    async def hand_over(self, asked: StateRequest) -> None:
        """Upload the committed checkpoint states the hub's referee asked for; when some are no
        longer kept, say so at once instead (the referee cannot re-execute without them, so
        the others are not sent)."""
        client = self._client()
        self.output.event("state_request", request_id=asked.request_id, assignment_id=asked.assignment_id,
                          steps=list(asked.steps))
        held = set(await asyncio.to_thread(self.checkpoints.held, asked.assignment_id, asked.steps))
        if missing := [s for s in asked.steps if s not in held]:
            msg = StateUnavailable(request_id=asked.request_id, steps=tuple(missing),
                                   reason="pruned from the node's checkpoint store", timestamp=client.now(),
                                   nonce=new_nonce())
            ack = await client.states_unavailable(msg)
            self.output.event("state_missing", request_id=asked.request_id, steps=missing, ok=ack.ok)
            return
        for step in asked.steps:
            data = await asyncio.to_thread(self.checkpoints.read, asked.assignment_id, step)
            if data is None:  # dropped between the look and the read: said on the next ask
                self.output.event("state_missing", request_id=asked.request_id, steps=[step])
                return
            hdr = StateUpload(request_id=asked.request_id, step=step, state_sha256=hashlib.sha256(data).hexdigest(),
                              state_size=len(data), timestamp=client.now(), nonce=new_nonce())
            ack = await client.upload_state(hdr, data)
            self.output.event("state_sent", request_id=asked.request_id, step=step, bytes=len(data), ok=ack.ok)

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
            "samples_per_s": round(self.last_samples_per_s, 2),
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
        if self._holds(held):
            outcome = "pending"
        elif held in self._abandoned:
            outcome = "handed_back" if self._abandoned[held] else "not_told"
        else:
            outcome = "ended"
        result["assignment"] = {"assignment_id": held, "outcome": outcome}
        return result

    def _holds(self, assignment_id: str) -> bool:
        cur = self.current
        return cur is not None and cur.assignment.assignment_id == assignment_id

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
        benchmark = self.config.benchmark or await asyncio.to_thread(self._benchmark)
        local = (self.config.source_address, 0) if self.config.source_address else None
        connector = aiohttp.TCPConnector(limit=8, local_addr=local)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.client = HubClient(self.config.hub_url, self.key, session)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._work_loop_then_exit(benchmark))
                tg.create_task(self._heartbeat_loop())
                if self.config.control:
                    control = ControlServer(self, self.config.data_dir, self.output)
                    tg.create_task(control.serve(self.pause_state.exited))
                if self.config.yield_gpu and self.device.type == "cuda":
                    tg.create_task(yield_gpu_while_busy(self.pause_state, self.device, self.output))

    def _benchmark(self) -> Benchmark:
        from .benchcache import cache_path
        from .benchmark import benchmark_for_registration

        path = cache_path(self.config.data_dir, self.config.bench_cache)
        return benchmark_for_registration(
            self.device, path,
            on_measure=lambda: self.output.event(
                "benchmark", detail=f"measuring this machine once (a second or two); cached in {path}"
            ),
        )

    async def _work_loop_then_exit(self, benchmark: Benchmark) -> None:
        try:
            await self._work_loop(benchmark)
        finally:
            self.request_exit("done")

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
                if not await self._handle(item, inline_model=inline):
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
                self._stop(self._forged(exc), EXIT_KEY_MISMATCH)
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

    def _forged(self, exc: BadSignature) -> HubForged:
        where = (
            "given with --hub-key" if self.config.hub_key
            else f"pinned in {self.config.data_dir / PIN_FILE}"
        )
        log.warning("forged work answer: %s", exc)
        return HubForged(
            f"REFUSING TO WORK: someone is forging the hub. Work from the hub at "
            f"{self.config.hub_url} is not signed by the hub key this node trusts, "
            f"{self.hub_fingerprint or '(none)'} ({where}). Nothing was downloaded or trained. "
            f"Tell the hub operator, and start this node again once the hub is trustworthy."
        )

    def _client(self) -> HubClient:
        if self.client is None:
            raise HubUnavailable("no hub client")
        return self.client

    async def _connect(self, benchmark: Benchmark) -> None:
        pin = await register(
            self._client(), data_dir=self.config.data_dir, hub_url=self.config.hub_url,
            expected_hub_key=self.config.hub_key, node_id=self.node_id, device=self.device,
            benchmark=benchmark, compute=self.compute, enroll_token=self.config.enroll_token,
        )
        self.registered = True
        self._benchmark_msg = benchmark
        self.output.event(
            "registered", node_id=self.node_id, hub=self.config.hub_url,
            hub_fingerprint=pin.fingerprint, device=str(self.device),
            samples_per_s=round(benchmark.samples_per_s, 1),
        )

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
            a, node_id=self.node_id, now=self._client().now(), seen=self._seen_assignments,
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
                    await self._tell_withdrawn(exc.job_id, exc.sha256)
                await self._tell_abandon(a.assignment_id, f"rejected: {exc}"[:256])
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
            cur.phase = "downloading"
            self.state = "downloading"
            t0 = time.perf_counter()
            if inline_model is not None:
                await self.transfers.accept_inline_model(a, inline_model)
            fetched = await pause.interruptible(self.transfers.fetch_all(self._client(), a, local=local))
            download_s = time.perf_counter() - t0

            global_state, chunks = await asyncio.to_thread(
                functools.partial(load_inputs, self.cache, a, spec, silos=self.silos, local=local))
            if a.train.error_feedback:
                shapes = {k: tuple(v.shape) for k, v in global_state.items() if v.is_floating_point()}
                cur.residual = await asyncio.to_thread(self.feedback.load, a.job_id, shapes)
            cur.phase = "training"
            self.state = "training"
            self.output.progress_start(f"training {a.assignment_id[:12]} r{a.round}")
            if self.stop_training.is_set():
                raise TrainingStopped("stopped before training")
            try:
                result = await asyncio.to_thread(self.train, a, chunks, global_state)
            finally:
                self.output.progress_stop()
            try:
                check_finite(result.delta)
            except ProtocolError as exc:
                raise TrainError(f"training diverged: {exc}") from exc
            processed = samples_processed(result.sample_count, a.train.batch_size, a.train.local_epochs,
                                          a.train.local_steps)
            self.last_samples_per_s = processed / max(result.train_s, 1e-9)
            self.output.event(
                "trained", assignment_id=a.assignment_id, loss=result.loss, train_s=round(result.train_s, 4),
                steps=result.steps, samples_per_s=round(self.last_samples_per_s, 1),
            )
            result = self.transform_update(a, result)
            if a.train.secagg:  # the update leaves masked (node/secagg_flow.py), never in the clear
                cur.phase = "uploading"
                self.state = "uploading"
                outcome = await secagg_flow.take_part(self._client(), self.node_id, a, result.delta,
                                                      sample_count=result.sample_count, loss=result.loss,
                                                      train_s=result.train_s)
                self._seen_assignments.add(a.assignment_id)
                if outcome.phase == "unmasked":
                    self.totals.uploaded += 1
                    self.totals.samples_trained += processed
                    self.totals.train_s += result.train_s
                self.output.event("uploaded", assignment_id=a.assignment_id, update_sha256=outcome.sha256,
                                  bytes=outcome.size, ok=outcome.phase == "unmasked", masked=True,
                                  detail=outcome.detail or "secure aggregation: the hub sums the masked updates",
                                  fetched_bytes=fetched)
                return True
            try:
                encoded = await asyncio.to_thread(self.encode_update, a, result, cur.residual)
            except ProtocolError as exc:
                raise TrainError(f"cannot encode the update as {a.train.update}: {exc}") from exc
            cur.phase = "uploading"
            self.state = "uploading"
            sent = await self.transfers.upload(
                self._client(), a, dataclasses.replace(result, delta=encoded.wire), download_s=download_s,
                deadline=lambda: self.current.deadline if self.current else a.deadline,
                reregister=self._reregister,
            )
            if sent is not None:
                self._seen_assignments.add(a.assignment_id)  # done: the same one again is a replay
                if encoded.residual is not None and sent.ack.ok:  # only an accepted update moves it on
                    await asyncio.to_thread(self.feedback.save, a.job_id, encoded.residual)
                self.totals.uploaded += 1
                self.totals.samples_trained += processed
                self.totals.train_s += result.train_s
                self.output.event(
                    "uploaded", assignment_id=a.assignment_id, update_sha256=sent.sha256, bytes=sent.size,
                    ok=sent.ack.ok, detail=sent.ack.detail, fetched_bytes=fetched,
                )
            return True
        except TrainingStopped:
            reason = cur.stop_reason or ("paused" if self.paused else "shutting down")
            await self._abandon(a, reason)
        except Interrupted:
            reason = "paused" if self.paused else "shutting down"
            await self._abandon(a, reason)
            raise
        except (TrainError, BlobError) as exc:
            self.output.event("rejected", assignment_id=a.assignment_id, **json_error_detail(exc))
            self.totals.rejected += 1
            await self._tell_abandon(a.assignment_id, f"rejected: {exc}"[:256])
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
            await self._abandon(a, "node re-registered")
        except HubError as exc:
            self.output.event("error", assignment_id=a.assignment_id, **json_error_detail(exc))
            await self._abandon(a, f"hub error: {exc.code or exc.status}")
        except (HubUnavailable, AssignmentRejected):
            raise
        except Exception as exc:
            await self._abandon(a, f"node error: {type(exc).__name__}")
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

    async def _abandon(self, a: Assignment, reason: str) -> None:
        self.totals.abandoned += 1
        told = await self._tell_abandon(a.assignment_id, reason)
        self._abandoned[a.assignment_id] = told
        while len(self._abandoned) > 16:  # only the latest are asked about (pause_and_report)
            del self._abandoned[next(iter(self._abandoned))]
        self.output.event("abandoned", assignment_id=a.assignment_id, reason=reason, hub_told=told)

    async def _tell_abandon(self, assignment_id: str, reason: str) -> bool:
        try:
            async with asyncio.timeout(self.config.abandon_timeout_s):
                await self._client().abandon(assignment_id, reason, limit_s=self.config.abandon_timeout_s)
            return True
        except (NodeError, TimeoutError) as exc:
            log.info("could not tell the hub about abandoning %s: %s", assignment_id, exc)
            return False

    async def _tell_withdrawn(self, job_id: str, sha256: str) -> None:
        try:
            async with asyncio.timeout(self.config.abandon_timeout_s):
                ack = await self._client().withdraw_silo(job_id, sha256, limit_s=self.config.abandon_timeout_s)
            self.output.event("silo_withdrawn", job_id=job_id, sha256=sha256, detail=ack.detail)
        except (NodeError, TimeoutError) as exc:
            log.info("could not tell the hub that the silo of job %s was removed: %s", job_id, exc)

    # ---------------------------------------------------------------- side loops

    async def _heartbeat_loop(self) -> None:
        """While an assignment is in hand, tell the hub we are alive (a slow device is not dead)."""
        pause = self.pause_state
        while not pause.exited.is_set():
            await pause.tick(self.config.heartbeat_s)
            cur = self.current
            if cur is None or cur.phase not in ("downloading", "training", "uploading") or pause.exiting:
                continue
            try:
                ack = await self._client().heartbeat(cur.assignment.assignment_id, cur.progress, cur.steps,
                                                     cur.digest)
            except Exception as exc:  # NodeError or a bug: the next beat tries again
                log.info("heartbeat failed: %s", exc)
                continue
            if ack.deadline > 0:
                cur.deadline = ack.deadline
            if not ack.ok and cur.phase != "uploading":
                # The hub no longer wants this assignment (expired, job cancelled): stop.
                cur.stop_reason = f"hub dropped it: {ack.detail}"[:256]
                self.output.event("error", detail=cur.stop_reason)
                self.stop_training.set()
            self.output.event(
                "heartbeat", assignment_id=cur.assignment.assignment_id, progress=round(cur.progress, 3)
            )


__all__ = ["Current", "NodeAgent", "NodeConfig", "Totals"]
