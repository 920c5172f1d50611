"""The `Store`: the hub's durable state behind one interface.

The ledger (hub/domain/ledger/) decides every state change and then calls exactly one
`Store` method for it. Each method is one unit of work: it commits everything it
was given in one transaction, or nothing, and returns only after the commit is
durable, so a 2xx built on it survives kill -9.

`Store` composes one smaller interface per aggregate: `NodeStore`, `JobStore` (jobs and their
rounds), `SiloStore` (a node-local job's silos), `AssignmentStore` (assignments, the updates they
bring, their shards' verdicts), `StateRequestStore` (the referee), `FlagStore` (the audit of
flags), `RollbackStore` (kept models and rollback) and `PipelineStore` (a pipelined job's generations
and unit states); a use case that needs one aggregate can ask for that one alone.

Two implementations run the same statements (`SqlStore`, hub/storage/store_sqlite.py) and the
same contract tests (tests/test_store_contract.py): `SqliteStore`, the default, and
`PostgresStore` (hub/storage/store_postgres.py, `serve --store postgresql://...`). Nothing above
this interface knows which store it talks to.

The read side (job status documents, flag lists, the console's pages) is not here:
those are queries, not state changes; they run through `Store.query` (see
hub/server/readmodel/) on a connection with sqlite3's interface: a `sqlite3.Connection`, or
on PostgreSQL a `PgConnection` that takes the same `?` statements and gives rows read by
name or position, as `sqlite3.Row` does.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..model.job import (
    AssignmentState,
    ChunkInfo,
    JobState,
    ShardState,
    StateRequestState,
    UpdateState,
)
from ..model.node import NodeState
from ..model.pipeline import Generation, StepReport, UnitRecord
from ..policy.rollback import JobHistory, Rollback
from ..policy.verification import Flag, Reputation

T = TypeVar("T")


@dataclass(frozen=True)
class NodeProfile:
    """What a node said about itself at registration (stored as given, shown to auditors)."""

    software_version: str
    device: dict[str, Any]
    benchmark: dict[str, Any]
    compute: dict[str, Any] = field(default_factory=dict)  # the ComputeClass (protocol/messages.py)


@dataclass(frozen=True)
class AssignmentFate:
    """What became of an assignment that is no longer live."""

    node_id: str
    state: str  # done|expired|abandoned|cancelled (live only in a race with the ledger)
    update_id: str | None


@dataclass(frozen=True)
class FlagRecord:
    """A stored flag: the suspicion, its evidence and its verdict."""

    id: str
    job_id: str
    round: int
    update_id: str
    node_id: str
    reason: str
    evidence: dict[str, Any]
    status: str  # open|confirmed|dismissed|moot
    verdict_note: str | None
    auditor: str | None
    created_at: float
    decided_at: float | None
    suspends: bool = False  # a proven mismatch: while open, its node is suspended

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RoundResult:
    """What closing a round produced: the next model and what went into it."""

    model_hash: str
    opt_state_sha: str | None
    statuses: dict[str, str]  # update id -> included|quarantined|excluded
    flags: list[Flag]
    evidence: dict[str, Any]
    metrics: dict[str, float]
    train_loss: float | None
    flagged_nodes: list[str]


@dataclass(frozen=True)
class CooldownLift:
    """The operator lifted a ban's block cooldown for ``address`` (an IP address or a block)."""

    address: str
    lifted_at: float
    lifted_by: str
    note: str = ""


@dataclass(frozen=True)
class LoadedState:
    nodes: list[NodeState]
    jobs: list[JobState]
    broken: list[tuple[str, str]]  # (job id, why it cannot be resumed)
    lifts: list[CooldownLift] = field(default_factory=list)


class NodeStore(Protocol):
    """Nodes: a registration, and the reputations verdicts change."""

    @abc.abstractmethod
    async def save_node(self, node_id: str, public_key: bytes, profile: NodeProfile, *, bench_sps: float,
                        now: float, address_block: str = "", operator: str | None = None) -> None:
        """Register a node or refresh its registration (reputation, throughput and history are kept).
        ``address_block``: the block it registers from now (it replaces the one recorded before);
        ``operator``: its enrollment token ('op-<id>'), kept once set."""

    @abc.abstractmethod
    async def save_reputations(self, reputations: Sequence[tuple[str, Reputation]]) -> None:
        """(node id, its new reputation): counters and ban state."""

    @abc.abstractmethod
    async def note_block(self, node_id: str, last_block: str) -> None:
        """The address block a known node was last seen in (replicas keep apart from it, and a
        ban cools it down, after a restart too)."""

    @abc.abstractmethod
    async def lift_cooldown(self, lift: CooldownLift) -> None:
        """The operator lifted a ban's block cooldown for ``lift.address`` (replacing an earlier
        lift of the same address)."""


class JobStore(Protocol):
    """Jobs and their rounds: a new job, the end of one, a round closed."""

    @abc.abstractmethod
    def insert_job_sync(self, job: JobState, spec_text: str, train_samples: int, val_samples: int) -> None:
        """A new job with its chunks, model version 0 and round 0 (from the ingest thread)."""

    @abc.abstractmethod
    async def job_state(self, job_id: str) -> str | None:
        """The stored state of a job (None if unknown)."""

    @abc.abstractmethod
    async def end_job(self, job_id: str, state: str, error: str | None, cancelled: Sequence[str]) -> None:
        """The job leaves the running states (done by close_round; cancelled; failed)."""

    @abc.abstractmethod
    async def fail_job(self, job_id: str, error: str, cancelled: Sequence[str] = ()) -> None:
        """The job ends as failed with `error`; its live assignments are cancelled."""

    @abc.abstractmethod
    async def close_round(self, job: JobState, result: RoundResult, *, flags: Sequence[Flag],
                          withdrawn: Sequence[str], cancelled: Sequence[str],
                          reputations: Sequence[tuple[str, Reputation]], last: bool, now: float,
                          carried: Sequence[tuple[str, ShardState]] = ()) -> None:
        """The round's outcome and the next model; the job moves on (or is done). ``carried``:
        live assignments that count in the next round (node-local, late = "next"), each with its
        new shard of that round."""


class SiloStore(Protocol):
    """A node-local job's silos: who holds which chunk."""

    @abc.abstractmethod
    async def save_silo(self, job_id: str, chunk: ChunkInfo, *, histogram: Sequence[int] | None, now: float) -> None:
        """A node's silo for a node-local job (``chunk.owner``): a new chunk row, or its earlier
        silo's row (same index) replaced."""

    @abc.abstractmethod
    async def withdraw_silo(self, job_id: str, idx: int, abandoned: Sequence[str]) -> None:
        """A node-local job's silo ``idx`` belongs to nobody any more (its chunk row stays, without
        an owner), and its live assignments ``abandoned`` end abandoned, in one transaction."""


class AssignmentStore(Protocol):
    """Assignments and the updates they bring: issued, extended, ended, delivered, settled."""

    @abc.abstractmethod
    async def issue_assignment(self, a: AssignmentState, new_shard: ShardState | None,
                               chunks: Sequence[ChunkInfo]) -> None:
        """A live assignment, and its shard with the shard's chunks when the shard is new."""

    @abc.abstractmethod
    async def extend_deadline(self, assignment_id: str, deadline: float) -> None: ...

    @abc.abstractmethod
    async def end_assignments(self, ids: Sequence[str], state: str) -> None:
        """Live assignments become `state` (expired|abandoned|cancelled); others are left alone."""

    @abc.abstractmethod
    async def assignment_fate(self, assignment_id: str) -> AssignmentFate | None: ...

    @abc.abstractmethod
    async def accept_update(self, upd: UpdateState, *, job_id: str, round: int, metrics: dict[str, float],
                            timings: dict[str, float], node: NodeState, first_update: bool,
                            settles: bool) -> None:
        """The update row, its assignment done, the node's throughput and count; the shard's
        first-update time when it is the first; the shard settled when it needs no replica.
        Raises DuplicateUpdate when the assignment already has an update."""

    @abc.abstractmethod
    async def want_replicas(self, shard_id: str, wanted: int, evidence: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def settle_shard(self, shard: ShardState, *, state: str, evidence: dict[str, Any], statuses: dict[str, str],
                           cancelled: Sequence[str], flags: Sequence[Flag], round: int,
                           reputations: Sequence[tuple[str, Reputation]], now: float) -> None:
        """A replica group's verdict: shard state, update statuses, void replicas, flags, reputations."""

    @abc.abstractmethod
    async def update_sha(self, update_id: str) -> str | None: ...

    @abc.abstractmethod
    async def uploads_before(self, job_id: str, node_id: str, before: float, *, but: str,
                             limit: int) -> list[str]:
        """The blob ids of a node's latest updates in a job received before ``before`` (newest
        first, at most ``limit``, not the update ``but``)."""


class StateRequestStore(Protocol):
    """The referee's state requests (hub/policy/referee.py): asked, answered, decided."""

    @abc.abstractmethod
    async def open_state_requests(self, requests: Sequence[StateRequestState]) -> None:
        """The referee asks nodes for checkpoint states: one row per request, status open."""

    @abc.abstractmethod
    async def record_state(self, request_id: str, step: int, sha: str) -> None:
        """A node handed over the state of ``step`` (its blob ``sha`` is stored already)."""

    @abc.abstractmethod
    async def decline_states(self, request_id: str, steps: Sequence[int]) -> None:
        """The node said it no longer holds the states of ``steps`` (messages.StateUnavailable);
        ``referee_requests`` gives them back as the request's ``declined``."""

    @abc.abstractmethod
    async def close_state_requests(self, outcomes: Sequence[tuple[str, str, dict[str, Any]]]) -> None:
        """(request id, reproduced|mismatch|unverifiable, evidence): the referee's verdicts."""

    @abc.abstractmethod
    async def referee_requests(self) -> list[tuple[StateRequestState, str, dict[str, Any]]]:
        """The referee's requests about shards still open (after a restart): each request with the
        states handed over so far, its status (open or a verdict) and the verdict's evidence."""


class FlagStore(Protocol):
    """The audit of suspicions: a flag, and an auditor's verdict on it."""

    @abc.abstractmethod
    async def flag(self, flag_id: str) -> FlagRecord | None: ...

    @abc.abstractmethod
    async def decide_flag(self, flag_id: str, *, status: str, note: str, auditor: str, now: float,
                          reputation: tuple[str, Reputation] | None,
                          moot_note: str | None) -> FlagRecord | None:
        """Record a verdict on an open flag, with the node's new reputation. When `moot_note` is
        given (the verdict banned the node), the node's other open flags become 'moot' with it.
        Returns the decided flag, or None when the flag was no longer open."""

    @abc.abstractmethod
    async def suspension(self, node_id: str) -> str | None:
        """Why the node is suspended (an open flag that suspends it), or None."""

    @abc.abstractmethod
    async def runs_before_flags(self, update_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
        """update id -> (node id, the run of agreements its node had when the update's
        replica_mismatch flag was written): what withdrawing that flag gives back."""


class RollbackStore(Protocol):
    """Rollback (hub/policy/rollback.py): the kept models, a job's aggregated history, a job
    rolled back, old models let go."""

    @abc.abstractmethod
    async def rollback_history(self, job_id: str) -> JobHistory | None:
        """What a rollback of the job is decided from; None for an unknown job."""

    @abc.abstractmethod
    async def kept_model(self, job_id: str, version: int) -> tuple[str, str | None] | None:
        """Model version ``version`` of the job and its server optimizer state, or None when it is
        not kept (the state is None for a model stored without one)."""

    @abc.abstractmethod
    async def roll_back(self, job_id: str, plan: Rollback, *, model_hash: str, opt_state_sha: str | None,
                        cancelled: Sequence[str], now: float) -> None:
        """The job goes back to ``model_hash`` (with ``opt_state_sha``) and opens ``plan.new_round``
        on it, running: the rounds ``plan.undone`` are marked rolled back, an open round among them
        closes with its shards dropped and its pending updates excluded, the live assignments
        ``cancelled`` end cancelled."""

    @abc.abstractmethod
    async def prune_models(self, job_id: str, below: int) -> list[str]:
        """Let the job's models under version ``below`` go (version 0 stays); the blob ids (models
        and optimizer states) no kept model and no job refers to any more, for the blob store to drop."""

    @abc.abstractmethod
    async def load_job(self, job_id: str) -> JobState | None:
        """A running or queued job as ``load`` rebuilds it (None when it is neither)."""



@dataclass(frozen=True)
class LoadedPipeline:
    """A running pipelined job as a restarted hub finds it: its committed step, the highest
    generation planned, the last one (to re-plan from) and the unit states at or after the
    committed step."""

    job_id: str
    committed_step: int
    generations: int
    last: Generation | None
    states: list[UnitRecord]


class PipelineStore(Protocol):
    """Pipelined jobs (hub/domain/pipelines): generations, unit states, the committed step, reports."""

    @abc.abstractmethod
    async def save_generation(self, generation: Generation, *, now: float) -> None:
        """A new generation of a job's pipeline; the one before it ends (``ended_at``)."""

    @abc.abstractmethod
    async def end_generation(self, job_id: str, number: int, *, now: float) -> None:
        """Generation ``number`` ends with no successor yet (the job waits for nodes)."""

    @abc.abstractmethod
    async def save_unit_state(self, job_id: str, record: UnitRecord, *, generation: int, node_id: str,
                              now: float, committed: int | None) -> None:
        """A unit's state at a step (its blob is stored already); ``committed``: the job's new
        committed step, when this state completes one. A state already recorded for (unit, step)
        is replaced."""

    @abc.abstractmethod
    async def flag_stage(self, job_id: str, step: int, flag: Flag, *, now: float) -> None:
        """A pipeline stage's work did not reproduce (hub/policy/stage_check.py): its flag (round:
        the step checked; update: what was checked), which suspends its node while open."""

    @abc.abstractmethod
    async def save_stage_report(self, job_id: str, report: StepReport) -> None:
        """One stage's report of one step (a repeated report of the same step replaces it)."""

    @abc.abstractmethod
    async def finish_pipeline(self, job_id: str, model_hash: str, model_size: int, *, now: float) -> None:
        """The final model (assembled from the unit states at the last step) becomes the job's
        model (version 1), and the job is done."""

    @abc.abstractmethod
    async def load_pipelines(self) -> list[LoadedPipeline]:
        """Every running pipelined job's durable pipeline state (a job never planned has none)."""


class Store(NodeStore, JobStore, SiloStore, AssignmentStore, StateRequestStore, FlagStore, RollbackStore,
            PipelineStore, Protocol):
    """Durable hub state: the aggregates' stores above, and what starts, reads and stops it. Every
    method commits once; none is called from a worker thread except the `*_sync` ones."""

    # -- start -------------------------------------------------------------------------------
    @abc.abstractmethod
    async def load(self) -> LoadedState:
        """Every node, and every active job's open round (shards, live assignments, updates)."""

    @abc.abstractmethod
    def first_admin_token_sync(self) -> str:
        """Create and return an admin token when there is none yet ('' otherwise)."""

    # -- the read side -----------------------------------------------------------------------
    @abc.abstractmethod
    async def query(self, fn: Callable[[Any], T]) -> T:
        """Run a read-only query function against the store's connection (hub/server/readmodel/):
        sqlite3's interface on either store (`?` placeholders, rows by name or position)."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise if the store cannot answer (health checks)."""

    @abc.abstractmethod
    def close(self) -> None: ...
