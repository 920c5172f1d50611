"""NodeAgent: register, take work, verify, download, train, upload, repeat.

One ``NodeAgent.run()`` is the whole running node: an ``asyncio.TaskGroup`` of the work
loop, the heartbeat loop, the local control server and (on a GPU) the GPU-yield watcher.
Nothing here is a process-wide singleton; tests build as many agents as they like.

Test tooling builds misbehaving contributors by overriding two methods (contract):

* ``train(assignment, chunks, global_state) -> TrainResult`` (runs in a worker thread)
* ``transform_update(assignment, result) -> TrainResult`` (identity here)

Trust rules: the hub key is pinned before anything else; every assignment's signature
and fields are checked before a byte is downloaded; every blob is size-capped and
hash-checked; the model comes only from the declarative spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import torch
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import (
    Assignment,
    Benchmark,
    DeviceInfo,
    Hello,
    NoWork,
    UpdateHeader,
)
from gpuflex.protocol.modelspec import ModelSpec, manifest, param_count
from gpuflex.protocol.signing import SigningKey, new_nonce
from gpuflex.protocol.tensors import (
    ITEMSIZE,
    MAX_HEADER_BYTES,
    StateEncoder,
    check_finite,
    check_manifest,
    load_state_file,
    sha256_hex,
)
from gpuflex.protocol.version import PROTOCOL_VERSION, SOFTWARE_VERSION
from torch import Tensor

from .cache import BlobCache
from .client import Backoff, HubClient, json_error_detail
from .device import GpuWatcher, apply_limits, describe, select_device
from .errors import (
    AssignmentRejected,
    BadSignature,
    Banned,
    BlobError,
    ConfigError,
    HubError,
    HubKeyMismatch,
    HubUnavailable,
    NodeError,
    TrainError,
    TrainingStopped,
    UnknownNode,
)
from .identity import check_hub_key, load_or_create_key, write_private_file
from .output import Output
from .trainer import TrainResult, train_assignment

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BLOB_BYTES = 8 << 30
MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600.0
CLOCK_SKEW_S = 300.0
TOTALS_EVERY_S = 2.0  # how often the counters file is rewritten while working
HEADER_ALLOWANCE = MAX_HEADER_BYTES + 64  # GFT1 header + alignment on top of raw tensor bytes


class Interrupted(Exception):
    """Internal: the node was paused or asked to exit while waiting."""


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
    bench_cache: Path | None = None  # shared benchmark cache file (default DIR/bench.json)


@dataclass
class Current:
    """The assignment in hand, as the status endpoint shows it."""

    assignment: Assignment
    spec: ModelSpec
    phase: str = "verifying"  # verifying|downloading|training|uploading
    progress: float = 0.0
    deadline: float = 0.0
    samples: int = 0
    started: float = field(default_factory=time.time)
    stop_reason: str = ""


@dataclass
class Totals:
    assignments: int = 0
    uploaded: int = 0
    rejected: int = 0
    abandoned: int = 0
    samples_trained: int = 0
    train_s: float = 0.0
    bytes_downloaded: int = 0
    bytes_uploaded: int = 0

    @classmethod
    def load(cls, path: Path) -> Totals:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
            return cls(**known)
        except (OSError, ValueError, TypeError):
            return cls()


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
        self.key = key or load_or_create_key(config.data_dir)
        self.node_id = self.key.fingerprint
        self.device = select_device(config.device)
        apply_limits(self.device, threads=config.threads, max_gpu_memory_gb=config.max_gpu_memory_gb)
        self.cache = BlobCache(config.data_dir / "cache", config.max_cache_bytes)
        self._encoder = StateEncoder()
        self._last_model: str | None = None
        self._totals_saved_at = -math.inf
        self.totals_path = config.data_dir / "totals.json"
        self.totals = Totals.load(self.totals_path)
        self.client: HubClient | None = None
        self.hub_fingerprint = ""
        self.registered = False
        self.state = "starting"
        self.current: Current | None = None
        self.last_samples_per_s = 0.0
        self.exit_code = 0
        self.fatal: NodeError | None = None
        self.paused = False
        self.pause_reason = ""
        self.done_assignments = 0
        self._seen_assignments: set[str] = set()
        self._benchmark_msg: Benchmark | None = None
        self._exiting = False
        # Thread-safe flag the training thread polls between batches.
        self._stop_training = threading.Event()
        self._exit_event: asyncio.Event | None = None
        self._interrupt: asyncio.Event | None = None
        self._resume_event: asyncio.Event | None = None

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

        return train_assignment(
            spec, global_state, chunks, assignment.train, assignment.seed,
            device=self.device, progress=progress, should_stop=self._stop_training.is_set,
        )

    def transform_update(self, assignment: Assignment, result: TrainResult) -> TrainResult:
        """The step between training and upload; identity in the shipped node."""
        return result

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
                "replica_group": a.replica_group,
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
            "assignment": assignment,
            "samples_per_s": round(self.last_samples_per_s, 2),
            "cache_bytes": self.cache.size_bytes(),
            "cache_cap_bytes": self.cache.max_bytes,
            "totals": dict(self.totals.__dict__),
        }

    def pause(self, reason: str = "user") -> bool:
        """Stop taking work; abandon the assignment in hand (the hub is told at once)."""
        if self.paused:
            return False
        self.paused = True
        self.pause_reason = reason
        self._stop_training.set()
        if self._interrupt is not None:
            self._interrupt.set()
        if self._resume_event is not None:
            self._resume_event.clear()
        self.output.event("paused", reason=reason)
        return True

    def resume(self) -> bool:
        if not self.paused:
            return False
        self.paused = False
        self.pause_reason = ""
        if not self._exiting:
            self._stop_training.clear()
            if self._interrupt is not None:
                self._interrupt.clear()
        if self._resume_event is not None:
            self._resume_event.set()
        self.output.event("resumed")
        return True

    def _on_signal(self, name: str) -> None:
        if self._exiting and name == "SIGINT":
            # A second Ctrl-C: the volunteer wants out now. Only verified blobs are ever
            # visible in the cache, so leaving mid-way cannot corrupt it.
            self.output.event("exit", code=130, detail="second interrupt: leaving at once")
            os._exit(130)
        self.request_exit(name)

    def request_exit(self, reason: str = "signal") -> None:
        if self._exiting:
            return
        self._exiting = True
        if reason != "done":
            self.output.event("stopping", reason=reason)
        self._stop_training.set()
        for ev in (self._interrupt, self._exit_event, self._resume_event):
            if ev is not None:
                ev.set()

    # ---------------------------------------------------------------- main

    async def run(self) -> int:
        """Run until --once / --max-assignments is satisfied, a signal, or a fatal error."""
        self._exit_event = asyncio.Event()
        self._interrupt = asyncio.Event()
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        if self._exiting:
            self.request_exit()
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        fallback: dict[signal.Signals, Any] = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig.name)
                installed.append(sig)
            except NotImplementedError:  # Windows: route the signal into the loop by hand
                with contextlib.suppress(ValueError, OSError):
                    fallback[sig] = signal.signal(
                        sig, lambda s, _f: loop.call_soon_threadsafe(self._on_signal, signal.Signals(s).name)
                    )
            except (RuntimeError, ValueError):  # not the main thread (tests): no handlers
                pass
        self.output.event(
            "starting", node_id=self.node_id, hub=self.config.hub_url, data_dir=str(self.config.data_dir),
            device=str(self.device), threads=torch.get_num_threads(), version=SOFTWARE_VERSION,
        )
        benchmark = self.config.benchmark or await asyncio.to_thread(self._benchmark)
        connector = aiohttp.TCPConnector(limit=8)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                self.client = HubClient(self.config.hub_url, self.key, session)
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._work_loop_then_exit(benchmark))
                    tg.create_task(self._heartbeat_loop())
                    if self.config.control:
                        from .control import ControlServer

                        tg.create_task(ControlServer(self, self.config.data_dir).serve(self._exit_event))
                    if self.config.yield_gpu and self.device.type == "cuda":
                        tg.create_task(self._gpu_yield_loop())
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            for sig, previous in fallback.items():
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(sig, previous)
            self.output.progress_stop()
            self._save_totals(force=True)
        self.output.event("exit", code=self.exit_code)
        return self.exit_code

    def _benchmark(self) -> Benchmark:
        from .benchmark import benchmark_for_registration, cache_path

        return benchmark_for_registration(self.device, cache_path(self.config.data_dir, self.config.bench_cache))

    async def _work_loop_then_exit(self, benchmark: Benchmark) -> None:
        try:
            await self._work_loop(benchmark)
        finally:
            self.request_exit("done")
            if self._exit_event is None:
                raise RuntimeError("_exit_event used before run() set it up")
            self._exit_event.set()

    async def _interruptible(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the node pauses or exits first (then cancel it, raise Interrupted)."""
        if self._interrupt is None:
            raise RuntimeError("_interrupt used before run() set it up")
        if self._interrupt.is_set():
            if asyncio.iscoroutine(aw):
                aw.close()
            raise Interrupted
        task = asyncio.ensure_future(aw)
        waiter = asyncio.ensure_future(self._interrupt.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, waiter):
                if not t.done():
                    t.cancel()
            for t in (task, waiter):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if task in done and not task.cancelled():
            return task.result()
        raise Interrupted

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(Interrupted):
            await self._interruptible(asyncio.sleep(seconds))

    async def _work_loop(self, benchmark: Benchmark) -> None:
        if self._resume_event is None:
            raise RuntimeError("_resume_event used before run() set it up")
        backoff = Backoff(self.config.backoff_base_s, self.config.backoff_cap_s)
        while not self._exiting:
            if self.paused:
                self.state = "paused"
                await self._resume_event.wait()
                continue
            try:
                if not self.registered:
                    self.state = "connecting"
                    await self._interruptible(self._connect(benchmark))
                self.state = "waiting"
                client = self._client()
                item, inline = await self._interruptible(
                    client.request_work(self.config.poll_wait_s, self._cached_chunk_ids())
                )
                if isinstance(item, NoWork):
                    backoff.reset()
                    self.output.event("no_work", reason=item.reason, retry_after_s=item.retry_after_s)
                    await self._sleep(min(item.retry_after_s, 30.0))
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
                self.fatal = exc
                self.output.event("error", fatal=True, **json_error_detail(exc))
                self.exit_code = 3 if isinstance(exc, HubKeyMismatch) else 4
                return
            except UnknownNode as exc:
                self.registered = False
                self.output.event("error", **json_error_detail(exc), action="re-register")
                await self._sleep(backoff.next_delay())
            except HubUnavailable as exc:
                self.state = "backoff"
                delay = backoff.next_delay()
                self.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
                await self._sleep(delay)
            except AssignmentRejected as exc:
                if isinstance(exc, BadSignature):
                    self.registered = False  # re-check the hub's key before trusting it again
                self.totals.rejected += 1
                self.output.event("rejected", **json_error_detail(exc))
                await self._sleep(backoff.next_delay())
            except HubError as exc:
                if exc.code == "version_mismatch":
                    self.fatal = exc
                    self.output.event("error", fatal=True, **json_error_detail(exc))
                    self.exit_code = 5
                    return
                if exc.code == "bad_answer":
                    self.registered = False  # re-check the hub's key before trusting it again
                delay = backoff.next_delay()
                self.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
                await self._sleep(delay)
            except Exception as exc:  # a bug must not end a volunteer's node: log, back off, go on
                log.exception("unexpected error in the work loop")
                delay = backoff.next_delay()
                self.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
                await self._sleep(delay)

    def _client(self) -> HubClient:
        if self.client is None:
            raise HubUnavailable("no hub client")
        return self.client

    async def _connect(self, benchmark: Benchmark) -> None:
        client = self._client()
        public_key, claimed, proto = await client.hub_info()
        pin = check_hub_key(self.config.data_dir, self.config.hub_url, public_key, claimed, self.config.hub_key)
        if proto != PROTOCOL_VERSION:
            raise HubError(
                f"hub speaks protocol {proto}, this node {PROTOCOL_VERSION}; upgrade the older side",
                code="version_mismatch",
            )
        client.hub_public_key = pin.public_key
        self.hub_fingerprint = pin.fingerprint
        d = describe(self.device)
        hello = Hello(
            software_version=SOFTWARE_VERSION[:64], protocol_version=PROTOCOL_VERSION,
            device=DeviceInfo(kind=d.kind, name=d.name[:256], memory_bytes=d.memory_bytes, threads=d.threads),
            benchmark=benchmark, timestamp=time.time(), nonce=new_nonce(),
        )
        welcome = await client.register(hello)
        if welcome.node_id != self.node_id or welcome.hub_fingerprint != pin.fingerprint:
            raise HubError(
                f"hub welcomed {welcome.node_id} under {welcome.hub_fingerprint}; expected "
                f"{self.node_id} under {pin.fingerprint}", code="bad_answer",
            )
        self.registered = True
        self._benchmark_msg = benchmark
        self.output.event(
            "registered", node_id=self.node_id, hub=self.config.hub_url,
            hub_fingerprint=pin.fingerprint, device=str(self.device),
            samples_per_s=round(benchmark.samples_per_s, 1),
        )

    def _cached_chunk_ids(self) -> list[str]:
        return self.cache.ids(4096)

    # ---------------------------------------------------------------- one assignment

    def check_assignment(self, a: Assignment) -> ModelSpec:
        """Field checks beyond the protocol's own; raises AssignmentRejected."""
        now = self._client().now()
        if a.node_id != self.node_id:
            raise AssignmentRejected(f"assignment {a.assignment_id} is for {a.node_id}, not this node")
        if a.assignment_id in self._seen_assignments:
            raise AssignmentRejected(f"assignment {a.assignment_id} was already handled (replay)")
        if a.deadline <= now:
            raise AssignmentRejected(f"assignment {a.assignment_id} deadline already passed")
        if a.deadline - now > MAX_DEADLINE_AHEAD_S or a.issued_at > now + CLOCK_SKEW_S:
            raise AssignmentRejected(f"assignment {a.assignment_id} has implausible times")
        if a.deadline <= a.issued_at:
            raise AssignmentRejected(f"assignment {a.assignment_id} deadline precedes its issue time")
        try:
            spec = ModelSpec.from_dict(a.model_spec)
            specs = manifest(spec)
            params = param_count(spec)
        except ProtocolError as exc:
            raise AssignmentRejected(f"assignment {a.assignment_id}: model spec refused: {exc}") from exc
        raw = sum(math.prod(t.shape) * _itemsize(t.dtype) for t in specs)
        if not raw <= a.model_size <= raw + HEADER_ALLOWANCE + 64 * len(specs):
            raise AssignmentRejected(
                f"assignment {a.assignment_id}: model_size {a.model_size} does not fit a "
                f"{params}-parameter model ({raw} bytes)"
            )
        if not a.chunks:
            raise AssignmentRejected(f"assignment {a.assignment_id} names no chunks")
        seen: set[str] = set()
        x_item = 8 if getattr(spec, "input_dtype", None) == torch.int64 else 4
        row = math.prod(spec.input_shape) * x_item + (8 if spec.task == "classification" else spec.outputs * 4)
        for c in a.chunks:
            if c.sha256 in seen:
                raise AssignmentRejected(f"assignment {a.assignment_id} names chunk {c.sha256[:12]}… twice")
            seen.add(c.sha256)
            if c.samples < 1 or not c.samples * row <= c.size <= c.samples * row + HEADER_ALLOWANCE:
                raise AssignmentRejected(
                    f"assignment {a.assignment_id}: chunk {c.sha256[:12]}… declares {c.size} bytes "
                    f"for {c.samples} samples of {row} bytes"
                )
            if c.size > MAX_BLOB_BYTES:
                raise AssignmentRejected(f"chunk {c.sha256[:12]}… is larger than {MAX_BLOB_BYTES} bytes")
        need = a.model_size + sum(c.size for c in a.chunks)
        if need > self.cache.max_bytes:
            raise AssignmentRejected(
                f"assignment {a.assignment_id} needs {need / 1e9:.2f} GB of cache, cap is "
                f"{self.cache.max_bytes / 1e9:.2f} GB; raise --max-cache-gb"
            )
        return spec

    async def _handle(self, a: Assignment, *, inline_model: bytes | None = None) -> bool:
        """Work one assignment; True when it ran to an end (uploaded or refused), False if abandoned.

        ``inline_model``: the model's bytes when the hub sent them with the assignment.
        """
        self.totals.assignments += 1
        try:
            spec = self.check_assignment(a)
        except AssignmentRejected as exc:
            if a.node_id == self.node_id:
                await self._tell_abandon(a.assignment_id, f"rejected: {exc}"[:256])
            raise
        if not self.paused and not self._exiting:
            self._stop_training.clear()  # a stop meant for the previous assignment is spent
        cur = Current(assignment=a, spec=spec, deadline=a.deadline)
        cur.samples = sum(c.samples for c in a.chunks)
        self.current = cur
        self.output.event(
            "assignment", assignment_id=a.assignment_id, job_id=a.job_id, round=a.round,
            chunks=len(a.chunks), samples=cur.samples, replica_group=a.replica_group,
        )
        try:
            cur.phase = "downloading"
            self.state = "downloading"
            t0 = time.perf_counter()
            if inline_model is not None:
                self._accept_inline_model(a, inline_model)
            fetched = await self._interruptible(self._fetch_all(a))
            download_s = time.perf_counter() - t0

            global_state, chunks = self._load_inputs(a, spec)
            cur.phase = "training"
            self.state = "training"
            self.output.progress_start(f"training {a.assignment_id[:12]} r{a.round}")
            self._check_stop()
            try:
                result = await asyncio.to_thread(self.train, a, chunks, global_state)
            finally:
                self.output.progress_stop()
            try:
                check_finite(result.delta)
            except ProtocolError as exc:
                raise TrainError(f"training diverged: {exc}") from exc
            self.last_samples_per_s = result.sample_count * a.train.local_epochs / max(result.train_s, 1e-9)
            self.output.event(
                "trained", assignment_id=a.assignment_id, loss=result.loss, train_s=round(result.train_s, 4),
                steps=result.steps, samples_per_s=round(self.last_samples_per_s, 1),
            )
            result = self.transform_update(a, result)
            cur.phase = "uploading"
            self.state = "uploading"
            await self._upload(a, result, download_s=download_s, fetched=fetched)
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
            await self._interruptible(self._connect(self._benchmark_msg))
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
            self._save_totals()
            with contextlib.suppress(OSError):
                self.cache.evict()
        return False

    def _check_stop(self) -> None:
        if self._stop_training.is_set():
            raise TrainingStopped("stopped before training")

    async def _abandon(self, a: Assignment, reason: str) -> None:
        self.totals.abandoned += 1
        told = await self._tell_abandon(a.assignment_id, reason)
        self.output.event("abandoned", assignment_id=a.assignment_id, reason=reason, hub_told=told)

    async def _tell_abandon(self, assignment_id: str, reason: str) -> bool:
        try:
            async with asyncio.timeout(self.config.abandon_timeout_s):
                await self._client().abandon(assignment_id, reason, limit_s=self.config.abandon_timeout_s)
            return True
        except (NodeError, TimeoutError) as exc:
            log.info("could not tell the hub about abandoning %s: %s", assignment_id, exc)
            return False

    def _accept_inline_model(self, a: Assignment, data: bytes) -> None:
        """Cache a model that came with the assignment, if it is the one the assignment names.

        Anything else is dropped with an event and the model is downloaded as usual.
        """
        if self.cache.has(a.model_hash, a.model_size):
            return
        if len(data) != a.model_size:
            self.output.event("inline_model_refused", assignment_id=a.assignment_id,
                              detail=f"{len(data)} bytes, the assignment says {a.model_size}")
            return
        writer = self.cache.writer(a.model_hash, a.model_size, resume=False)
        try:
            writer.write(data)
            writer.commit()  # checks the sha256 against the signed model_hash
        except BlobError as exc:
            self.output.event("inline_model_refused", assignment_id=a.assignment_id, detail=str(exc))
            return
        self.totals.bytes_downloaded += len(data)

    async def _fetch_all(self, a: Assignment) -> int:
        """Download the model and the chunks we lack; return bytes fetched."""
        wanted = [(a.model_hash, a.model_size, "model")] + [(c.sha256, c.size, "chunk") for c in a.chunks]
        missing = []
        for sha, size, kind in wanted:
            # A blob left by an earlier run is re-hashed once before use (the cache does not fsync).
            if self.cache.has(sha, size) and (
                sha in self.cache.verified or await asyncio.to_thread(self.cache.verify, sha)
            ):
                self.cache.touch(sha)
            else:
                missing.append((sha, size, kind))
        if self._last_model is not None and self._last_model != a.model_hash:
            self.cache.discard(self._last_model)  # a model blob serves one round: do not let them pile up
        self._last_model = a.model_hash
        self.output.event("cache", assignment_id=a.assignment_id, hits=len(wanted) - len(missing),
                          misses=len(missing))
        fetched = 0
        gate = asyncio.Semaphore(4)  # a few blobs in flight: round trips overlap, memory stays bounded

        async def one(sha: str, size: int, kind: str) -> None:
            nonlocal fetched
            async with gate:
                got = await self._download(sha, size)
            fetched += got
            self.output.event("download", assignment_id=a.assignment_id, sha256=sha, kind=kind, bytes=got)

        try:
            async with asyncio.TaskGroup() as tg:
                for sha, size, kind in missing:
                    tg.create_task(one(sha, size, kind))
        except BaseExceptionGroup as group:
            # Surface the first failure as itself so the callers' except clauses apply.
            first = group.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        return fetched

    async def _download(self, sha: str, size: int) -> int:
        client = self._client()
        backoff = Backoff(self.config.backoff_base_s, min(self.config.backoff_cap_s, 10.0))
        got = 0

        def count(n: int) -> None:
            nonlocal got
            got += n
            self.totals.bytes_downloaded += n

        for attempt in range(6):
            writer = self.cache.writer(sha, size, resume=True)
            try:
                await client.download_blob(sha, writer, on_bytes=count)
                writer.commit()
                return got
            except HubUnavailable:
                writer.abort(keep_partial=True)
                if attempt == 5:
                    raise
                await asyncio.sleep(backoff.next_delay())
            except BaseException:
                writer.abort(keep_partial=True)
                raise
        return got

    def _load_inputs(
        self, a: Assignment, spec: ModelSpec
    ) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
        try:
            global_state = load_state_file(self.cache.touch(a.model_hash))
            check_manifest(global_state, manifest(spec))
            chunks = []
            for c in a.chunks:
                chunk = load_state_file(self.cache.touch(c.sha256))
                x = chunk.get("x")
                if x is None or x.shape[0] != c.samples:
                    raise TrainError(f"chunk {c.sha256[:12]}… does not hold {c.samples} samples")
                chunks.append(chunk)
        except ProtocolError as exc:
            raise TrainError(f"assignment {a.assignment_id}: inputs refused: {exc}") from exc
        return global_state, chunks

    async def _upload(self, a: Assignment, result: TrainResult, *, download_s: float, fetched: int) -> None:
        client = self._client()
        t0 = time.perf_counter()
        # One buffer reused every round: a fresh 100 MB one costs more in page faults than the copy.
        body = await asyncio.to_thread(self._encoder.encode, result.delta)
        digest = sha256_hex(body)
        encode_s = time.perf_counter() - t0
        backoff = Backoff(self.config.backoff_base_s, min(self.config.backoff_cap_s, 10.0))
        reregistered = False
        resigned = False
        while True:
            header = UpdateHeader(
                assignment_id=a.assignment_id, update_sha256=digest, update_size=len(body),
                sample_count=result.sample_count, metrics={"loss": _finite(result.loss)},
                timings={"train_s": result.train_s, "download_s": download_s, "encode_s": encode_s},
                timestamp=client.now(), nonce=new_nonce(),
            )
            try:
                ack = await client.upload_update(header, body)
            except HubUnavailable as exc:
                if client.now() > (self.current.deadline if self.current else a.deadline) or self._exiting:
                    raise
                delay = backoff.next_delay()
                self.output.event("error", **json_error_detail(exc), retry_in_s=round(delay, 2))
                await self._interruptible(asyncio.sleep(delay))
                continue
            except UnknownNode as exc:
                # The hub forgot us (restarted with a fresh node table): register again and
                # offer the same update once more; the hub decides whether it is still wanted.
                self.registered = False
                if reregistered or self._benchmark_msg is None:
                    self.totals.rejected += 1
                    self.output.event("rejected", assignment_id=a.assignment_id, **json_error_detail(exc))
                    return
                reregistered = True
                self.output.event("error", **json_error_detail(exc), action="re-register")
                await self._interruptible(self._connect(self._benchmark_msg))
                continue
            except HubError as exc:
                if exc.code == "replay" and not resigned:
                    # Our own fresh header called a replay: the hub restarted an instant ago (it
                    # refuses anything signed before its start) or the clocks disagree. Signing
                    # again is always safe: the hub accepts one update per assignment.
                    resigned = True
                    self.output.event("error", **json_error_detail(exc), action="sign again")
                    await self._interruptible(asyncio.sleep(0.5))
                    continue
                self.totals.rejected += 1
                self.output.event("rejected", assignment_id=a.assignment_id, **json_error_detail(exc))
                return
            break
        self._seen_assignments.add(a.assignment_id)  # done: the same assignment again is a replay
        self.totals.uploaded += 1
        self.totals.samples_trained += result.sample_count * a.train.local_epochs
        self.totals.train_s += result.train_s
        self.totals.bytes_uploaded += len(body)
        self.output.event(
            "uploaded", assignment_id=a.assignment_id, update_sha256=digest, bytes=len(body),
            ok=ack.ok, detail=ack.detail, fetched_bytes=fetched,
        )

    def _save_totals(self, *, force: bool = False) -> None:
        """Persist the counters: at most every TOTALS_EVERY_S while working, and at exit.

        They are statistics for `gpuflex-node status`; a kill -9 loses at most a few
        seconds of counts, and the file is replaced whole (never half-written).
        """
        now = time.monotonic()
        if not force and now - self._totals_saved_at < TOTALS_EVERY_S:
            return
        self._totals_saved_at = now
        with contextlib.suppress(OSError):
            write_private_file(self.totals_path, json.dumps(self.totals.__dict__) + "\n", durable=False)

    # ---------------------------------------------------------------- side loops

    async def _heartbeat_loop(self) -> None:
        """While an assignment is in hand, tell the hub we are alive (a slow device is not dead)."""
        if self._exit_event is None:
            raise RuntimeError("_exit_event used before run() set it up")
        while not self._exit_event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.heartbeat_s):
                    await self._exit_event.wait()
            cur = self.current
            if cur is None or cur.phase not in ("downloading", "training", "uploading") or self._exiting:
                continue
            try:
                ack = await self._client().heartbeat(cur.assignment.assignment_id, cur.progress)
            except Exception as exc:  # NodeError or a bug: the next beat tries again
                log.info("heartbeat failed: %s", exc)
                continue
            if ack.deadline > 0:
                cur.deadline = ack.deadline
            if not ack.ok and cur.phase != "uploading":
                # The hub no longer wants this assignment (expired, job cancelled): stop.
                cur.stop_reason = f"hub dropped it: {ack.detail}"[:256]
                self.output.event("error", detail=cur.stop_reason)
                self._stop_training.set()
            self.output.event(
                "heartbeat", assignment_id=cur.assignment.assignment_id, progress=round(cur.progress, 3)
            )

    async def _gpu_yield_loop(self) -> None:
        if self._exit_event is None:
            raise RuntimeError("_exit_event used before run() set it up")
        watcher = await asyncio.to_thread(GpuWatcher, self.device)
        if not watcher.available:
            self.output.event("note", detail="GPU yielding off (nvidia-ml-py missing or NVML unavailable)")
            return
        while not self._exit_event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._exit_event.wait()
            busy = await asyncio.to_thread(watcher.others_busy)
            if busy and not self.paused:
                self.pause("gpu_busy")
            elif not busy and self.paused and self.pause_reason == "gpu_busy":
                self.resume()


def _itemsize(dtype: str) -> int:
    return int(ITEMSIZE[dtype])


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


__all__ = ["Current", "NodeAgent", "NodeConfig", "Totals"]
