"""The in-memory picture of a job's round: plain state types the whole hub shares.

The store is the truth; `JobState` is the event loop's working copy, rebuilt from the store on
start (`Store.load`), changed only by the ledger, on the loop (hub/domain/ledger/). Submission
ingest (validate, chunk, store) is hub/domain/jobs.py.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from gpuflex.protocol.encoding import UpdateEncoding
from gpuflex.protocol.jobspec import JobSpec
from gpuflex.protocol.messages import Commitment, TrainConfig
from gpuflex.protocol.modelspec import update_manifest
from gpuflex.protocol.tensors import ITEMSIZE, Manifest, max_encoded_size

from ..policy.round_policy import trend_base_round
from ..policy.secagg import SecAggRound, secagg_length

if TYPE_CHECKING:
    from torch import Tensor

    from ..policy.referee import SegmentVerdict

ACTIVE_STATES = ("queued", "running")
#: earlier models kept named in memory at least: a node holding one gets the next as a delta
DELTA_BASES = 2


@dataclass(frozen=True)
class ChunkInfo:
    idx: int
    sha: str
    samples: int
    size: int
    #: a node-local job's chunk is a silo: the one node that holds it (None: a hub chunk)
    owner: str | None = None


@dataclass
class UpdateState:
    id: str
    assignment_id: str
    shard_id: str
    node_id: str
    sha: str
    size: int
    sample_count: int
    loss: float
    train_s: float
    received_at: float
    status: str = "accepted"  # accepted|redundant|quarantined|included|excluded
    elapsed_s: float | None = None  # hub-observed: upload time - assignment issue time
    #: the node's signed checkpoint commitment (hub/policy/referee.py), None when it sent none
    commitment: Commitment | None = None


@dataclass
class AssignmentState:
    id: str
    shard_id: str
    job_id: str
    round: int
    node_id: str
    issued_at: float
    expected_s: float
    deadline: float
    sealed: bytes
    model_hash: str
    chunk_shas: frozenset[str]
    uploading: bool = False
    #: node-local, [data] late = "next": the round it was issued in, once a round close carried it
    #: into the next (it is carried once; memory only)
    carried_from: int | None = None


@dataclass
class StateRequestState:
    """The referee asks ``node_id`` for the committed states at ``steps`` of one update
    (messages.StateRequest); ``states``: step -> blob sha of what it handed over so far."""

    id: str
    job_id: str
    round: int
    shard_id: str
    update_id: str
    node_id: str
    assignment_id: str
    reason: str  # disagreement|spot_check
    segment: int
    steps: tuple[int, ...]
    requested_at: float
    deadline: float
    states: dict[int, str] = field(default_factory=dict)
    #: the node was handed the request (it polled for work since it was opened): a node that never
    #: came back was offline, not refusing (hub/domain/rounds.py: "unreachable", no flag)
    asked: bool = False
    #: steps the node said it no longer holds (messages.StateUnavailable): the referee decides at
    #: once, and leaves the update out without a flag
    declined: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """Nothing more to wait for: every state is handed over, or the node declared one it no
        longer holds (the segment cannot be re-executed without it)."""
        return bool(self.declined) or all(s in self.states for s in self.steps)


@dataclass
class ShardState:
    id: str
    job_id: str
    round: int
    seq: int
    seed: int
    chunk_idxs: tuple[int, ...]
    samples: int
    replica_group: str
    wanted: int
    state: str = "open"  # open|settled|dropped
    first_update_at: float | None = None
    live: dict[str, AssignmentState] = field(default_factory=dict)
    nodes: set[str] = field(default_factory=set)
    accepted: list[UpdateState] = field(default_factory=list)
    representative: str | None = None
    unverified: str | None = None  # why its representative was never confirmed by a replica
    carved_at: float | None = None  # when the scheduler cut it (memory only; None after a restart)
    comparison: str | None = None  # a settled replica group: "same_class" | "cross_class" (policy.Comparison)
    #: node-local, late = "next": the round whose close carried this shard's assignment here
    carried_from: int | None = None
    #: the referee's open state requests (update id -> request) and its verdicts (update id -> verdict)
    requests: dict[str, StateRequestState] = field(default_factory=dict)
    verdicts: dict[str, SegmentVerdict] = field(default_factory=dict)

    def replicas_needed(self) -> int:
        return self.wanted - len(self.live) - len(self.accepted)


@dataclass(frozen=True)
class UpdateLayout:
    """A job's update encoding with the manifest of an update's dense tensors (the model's, or a
    LoRA job's adapters) and the encoded one."""

    encoding: UpdateEncoding
    model: Manifest
    wire: Manifest

    @classmethod
    def of(cls, spec: JobSpec) -> UpdateLayout:
        enc = spec.communication.encoding
        model = update_manifest(spec.model)  # a LoRA job's updates carry only its adapters
        return cls(enc, model, enc.wire_manifest(model))

    @cached_property
    def max_update_bytes(self) -> int:
        """The most bytes an update in this encoding can be (its tensors in any order)."""
        return max_encoded_size(self.wire)

    @property
    def dense_bytes(self) -> int:
        """The bytes of one update decoded to the model's tensors."""
        return sum(math.prod(t.shape) * ITEMSIZE[t.dtype] for t in self.model)

    def dense(self, wire: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The update as the model's tensors (the views themselves for fp32)."""
        return self.encoding.decode(wire, self.model)


@dataclass
class JobState:
    id: str
    owner: str
    name: str
    spec: JobSpec
    state: str
    round: int
    rounds: int
    model_hash: str
    model_size: int
    chunks: list[ChunkInfo]
    val_sha: str | None
    opt_state_sha: str | None
    created_at: float
    shards: dict[str, ShardState] = field(default_factory=dict)
    free: set[int] = field(default_factory=set)  # chunk idxs no live/settled shard holds
    free_total: int = 0  # samples in `free` (kept by take/release/open_round)
    #: the round's pool when it opened: chunks and samples (the unproven cap's equal part and
    #: [train] lr_scaling read them; set by open_round, which a restored job passes through too)
    pool_chunks: int = 0
    pool_samples: int = 0
    next_seq: int = 0
    closing: bool = False
    live_n: int = 0  # live assignments of this job (kept by Scheduler.attach/detach)
    #: open replicated shards that may still want a replica (the scheduler drops those that do not
    #: as it meets them; a detach or a raised `wanted` puts a shard back)
    replicated: dict[str, ShardState] = field(default_factory=dict)
    _by_idx: dict[int, ChunkInfo] | None = field(default=None, repr=False, compare=False)
    #: the most holders (shard.nodes) any shard in `replicated` has had this round: a bound
    #: the scheduler uses to rule a node out of every pending replica at once
    most_holders: int = 0
    cursor: int = 0  # every chunk index below it is taken (amortised O(1) carving)
    by_sha: dict[str, int] = field(default_factory=dict)
    #: why the job failed, or what went wrong while it could not be recorded yet (shown in its status)
    error: str | None = None
    #: the global model's blob by round, as far back as the trend audit looks (``trend_base``)
    models: dict[int, str] = field(default_factory=dict)
    #: bytes of models and chunks served to this round's assignments (since this hub started the
    #: round: a restart mid-round starts it again from 0); written into the round's metrics
    bytes_down: int = 0
    _layout: UpdateLayout | None = field(default=None, repr=False, compare=False)
    #: when this hub opened the current round (a restart opens it again): a node-local round's
    #: deadline counts from it
    round_opened_at: float = 0.0
    #: node-local: node id -> the index of its silo in ``chunks``
    silo_of: dict[str, int] = field(default_factory=dict)
    #: [privacy] secure_aggregation: this round's protocol state (hub/policy/secagg.py), and the last
    #: round's (its members may still ask how it ended)
    secagg: SecAggRound | None = None
    secagg_last: SecAggRound | None = None

    @property
    def node_local(self) -> bool:
        return self.spec.data.node_local

    def attach_silo(self, node_id: str, sha: str, samples: int, size: int) -> ChunkInfo:
        """A node's silo joins the job (or replaces its earlier one, keeping its index). A silo
        that no shard of this round holds yet is trained in this round too."""
        idx = self.silo_of.get(node_id)
        if idx is None:
            idx = len(self.chunks)
            chunk = ChunkInfo(idx, sha, samples, size, node_id)
            self.chunks.append(chunk)
            self.silo_of[node_id] = idx
            if self.active:
                self.free.add(idx)
                self.free_total += samples
        else:
            old = self.chunks[idx]
            chunk = ChunkInfo(idx, sha, samples, size, node_id)
            self.chunks[idx] = chunk
            self.by_sha.pop(old.sha, None)
            if idx in self.free:
                self.free_total += samples - old.samples
        self.by_sha[sha] = idx
        self._by_idx = None
        return chunk

    @property
    def layout(self) -> UpdateLayout:
        """What this job's updates look like on the wire (its [communication] encoding)."""
        if self._layout is None:
            self._layout = UpdateLayout.of(self.spec)
        return self._layout

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def live_count(self) -> int:
        return self.live_n

    def pooled(self, chunk: ChunkInfo) -> bool:
        """Does ``chunk`` go in a round's pool? Every chunk but a node-local job's withdrawn silos
        (no owner)."""
        return not (self.node_local and chunk.owner is None)

    def lr_scale(self, samples: int) -> float:
        """The factor on the spec's lr for a shard of ``samples`` ([train] lr_scaling: the samples
        the round pools over the shard's)."""
        return self.spec.train.lr_scale(samples, self.pool_samples)

    def train_config(self, samples: int, precision: str | None = None) -> TrainConfig:
        """The training settings of a shard of ``samples`` in this round: what an assignment
        carries to the node (``precision``: what that node trains in) and what the referee
        replays a segment with. One place, so the two cannot drift: the lr scaled for the
        shard ([train] lr_scaling), the checkpoint grid, how the update travels and, when the
        job asks for it, secure aggregation's settings."""
        spec = self.spec
        cfg = replace(spec.train.train_config(precision),
                      lr=spec.train.lr * self.lr_scale(samples),
                      checkpoint_every=int(spec.verification.checkpoint_every),
                      commit=spec.verification.asks_referee(),
                      update=spec.communication.update,
                      topk_fraction=spec.communication.topk_fraction,
                      error_feedback=spec.communication.error_feedback)
        p = spec.privacy
        if not p.secure_aggregation:
            return cfg
        return replace(cfg, secagg=True, secagg_clip=p.secagg_clip, secagg_bits=p.secagg_bits,
                       secagg_max_samples=spec.data.max_samples)

    def withdraw_silo(self, node_id: str) -> ChunkInfo | None:
        """A node's silo leaves the job (its operator removed it): no longer anyone's, never in
        the pool again, and no round waits for it. Its chunk keeps its index (rounds it trained
        name it). The withdrawn chunk, or None when the node had no silo."""
        idx = self.silo_of.pop(node_id, None)
        if idx is None:
            return None
        old = self.chunks[idx]
        self.chunks[idx] = chunk = ChunkInfo(idx, old.sha, old.samples, old.size, None)
        self.take([idx])
        self._by_idx = None
        return chunk

    def release(self, idxs: tuple[int, ...] | list[int]) -> None:
        """Chunks go back to the round's pool (a node-local job's withdrawn silos do not)."""
        back = [i for i in idxs if i not in self.free and self.pooled(self.chunks[i])]
        self.free.update(back)
        self.free_total += sum(self.chunks[i].samples for i in back)
        if idxs:
            self.cursor = min(self.cursor, min(idxs))

    def take(self, idxs: tuple[int, ...] | list[int]) -> None:
        """Chunks leave the pool for a shard."""
        gone = [i for i in idxs if i in self.free]
        self.free.difference_update(gone)
        self.free_total -= sum(self.chunks[i].samples for i in gone)

    def end(self, state: str) -> None:
        """The job is over: nothing is left to hand out."""
        self.state = state
        self.shards = {}
        self.replicated = {}
        self.most_holders = 0
        self.free = set()
        self.free_total = 0

    def free_samples(self) -> int:
        """Samples in the chunks no shard holds yet."""
        return self.free_total

    def covered_chunks(self) -> int:
        return sum(len(s.chunk_idxs) for s in self.shards.values() if s.state == "settled")

    def round_complete(self, now: float | None = None, online: Callable[[str], bool] | None = None) -> bool:
        """Every chunk trained and every shard decided. A node-local round instead closes once
        ``quorum`` silos have settled and no shard is being decided, when every silo whose node is
        ``online`` has delivered, or at ``round_deadline_s`` (a round short of its quorum waits
        for more silos to attach and deliver, however long)."""
        if self.secagg is not None:  # its masked updates settle their shards; the protocol ends the round
            return self.secagg.settled
        if self.node_local:
            return self._silo_round_complete(time.time() if now is None else now, online)
        return (
            not self.free
            and all(s.state != "open" for s in self.shards.values())
            and any(s.state == "settled" for s in self.shards.values())
        )

    def _silo_round_complete(self, now: float, online: Callable[[str], bool] | None) -> bool:
        shards = self.shards.values()
        if any(s.state == "open" and (s.accepted or s.requests) for s in shards):
            return False  # an update is being decided
        settled = sum(1 for s in shards if s.state == "settled")
        if settled < max(1, int(self.spec.data.quorum)):
            return False  # (until enough silos are attached and deliver: job status shows how many)
        if now >= self.round_opened_at + float(self.spec.data.round_deadline_s):
            return True
        if any(s.state == "open" and s.live for s in shards):
            return False  # a silo still trains
        return not any(online is None or (owner := self.chunks[i].owner) is None or online(owner)
                       for i in self.free)

    def silo_round_deadline(self) -> float:
        """When a node-local round closes with its quorum, whoever is still training."""
        return self.round_opened_at + float(self.spec.data.round_deadline_s)

    def note_model(self, round_: int, sha: str) -> None:
        """The model round ``round_`` trains from; rounds older than the trend's span are dropped."""
        self.models[round_] = sha
        keep = max(int(self.spec.verification.trend_rounds), DELTA_BASES)
        for r in [r for r in self.models if r < round_ - keep]:
            del self.models[r]

    def trend_base(self) -> str | None:
        """The model the current round's trend is measured from (policy.trend_base_round); None
        when there is none or it is not known."""
        base = trend_base_round(self.round, self.spec.verification)
        return None if base is None else self.models.get(base)

    def chunks_at(self, idxs: Iterable[int]) -> list[ChunkInfo]:
        """The chunks with these idxs, in that order (an index kept beside ``chunks``, which a job
        never changes after ingest: a dict per assignment cost O(chunks) each, 74 us at 1,000)."""
        by = self._by_idx
        if by is None or len(by) != len(self.chunks):
            by = self._by_idx = {c.idx: c for c in self.chunks}
        return [by[i] for i in idxs]

    def open_round(self) -> None:
        self.round_opened_at = time.time()
        p = self.spec.privacy
        if p.secure_aggregation:
            self.secagg_last = self.secagg
            floats = sum(math.prod(t.shape) for t in self.layout.model if t.dtype.startswith(("float", "bfloat")))
            self.secagg = SecAggRound(self.id, self.round, secagg_length(floats), quorum=int(self.spec.data.quorum),
                                      phase_s=float(p.secagg_phase_s), clip=float(p.secagg_clip),
                                      bits=int(p.secagg_bits), keys_s=float(self.spec.data.round_deadline_s),
                                      phase_at=self.round_opened_at)
        self.shards = {}
        self.bytes_down = 0
        self.replicated = {}
        self.most_holders = 0
        pool = [c for c in self.chunks if self.pooled(c)]
        self.free = {c.idx for c in pool}
        self.free_total = self.pool_samples = sum(c.samples for c in pool)
        self.pool_chunks = len(pool)
        self.cursor = 0
        self.next_seq = 0
        if len(self.by_sha) != len(self.chunks):
            self.by_sha = {c.sha: c.idx for c in self.chunks}
        if self.node_local and len(self.silo_of) != len(self.chunks):
            self.silo_of = {c.owner: c.idx for c in self.chunks if c.owner is not None}


def shard_seed(job_seed: int, round_: int, seq: int) -> int:
    """Pure function of (job seed, round, shard index): a restarted hub reproduces it."""
    digest = hashlib.sha256(f"gpuflex-shard:{job_seed}:{round_}:{seq}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def silo_seed(job_seed: int, round_: int, silo_sha: str) -> int:
    """A node-local shard's seed: of (job seed, round, the silo's blob id), whatever the order the
    silos were attached or trained in."""
    digest = hashlib.sha256(f"gpuflex-silo:{job_seed}:{round_}:{silo_sha}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"
