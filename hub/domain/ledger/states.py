"""The referee's state requests: the checkpoint states a node is asked to hand over so that the
referee can re-execute a segment of its update (hub/policy/referee.py decides what to ask and
judges the replay; the round engine, hub/domain/rounds.py, opens the requests and holds them)."""

from __future__ import annotations

import time

from gpuflex.protocol.messages import StateRequest, StateUnavailable, StateUpload
from gpuflex.protocol.signing import SigningKey, seal

from ...base.errors import BadRequest, Conflict, Forbidden, NotFound, Unprocessable
from ...model.job import StateRequestState
from ...model.node import NodeState
from ...storage.store import Store
from ..rounds import RoundEngine
from ..scheduler import Scheduler


class StateRequests:
    """A node's side of the referee's requests: what it is asked (``pending_state_request``), the
    states it hands over (``begin_state``, ``accept_state``) and those it no longer holds
    (``decline_states``)."""

    def __init__(self, *, key: SigningKey, store: Store, scheduler: Scheduler, rounds: RoundEngine) -> None:
        self.key = key
        self.store = store
        self.scheduler = scheduler
        self.rounds = rounds

    def pending_state_request(self, node: NodeState) -> bytes | None:
        """The signed StateRequest the node must answer first, if the referee waits on it."""
        now = time.time()
        for r in self.rounds.state_requests.values():
            if r.node_id == node.id and not r.complete and now < r.deadline:
                r.asked = True
                return seal(self.key, StateRequest(request_id=r.id, job_id=r.job_id, round=r.round,
                                                   assignment_id=r.assignment_id, steps=r.steps, deadline=r.deadline))
        return None

    def _open_request(self, node: NodeState, request_id: str) -> StateRequestState:
        """The open state request ``request_id`` made of ``node``, before its deadline."""
        r = self.rounds.state_requests.get(request_id)
        if r is None:
            raise NotFound(f"no open state request {request_id}", code="unknown_request")
        if r.node_id != node.id:
            raise Forbidden("that state request was made of another node", code="not_your_request")
        if time.time() >= r.deadline:
            raise Conflict("the state request's deadline has passed", code="late_state")
        return r

    def begin_state(self, node: NodeState, hdr: StateUpload) -> tuple[StateRequestState, str, int]:
        """Check a state upload's header against its request and the node's commitment; the
        expected sha and the most bytes such a state may have."""
        r = self._open_request(node, hdr.request_id)
        if hdr.step not in r.steps:
            raise BadRequest(f"step {hdr.step} was not requested (requested: {list(r.steps)})", code="bad_step")
        if hdr.step in r.declined:
            raise Conflict(f"the state of step {hdr.step} was declared no longer held", code="declined_state")
        job = self.scheduler.jobs.get(r.job_id)
        shard = job.shards.get(r.shard_id) if job is not None else None
        upd = next((u for u in shard.accepted if u.id == r.update_id), None) if shard is not None else None
        if job is None or upd is None or upd.commitment is None:
            raise Conflict("the update this request was about is gone", code="late_state")
        c = upd.commitment
        index = len(c.hashes) - 1 if hdr.step == c.steps else hdr.step // c.every  # its place on the grid
        expected = c.hashes[index]
        if hdr.state_sha256 != expected:
            raise Unprocessable(f"state of step {hdr.step} is not the one committed to", code="not_committed")
        # params + optimizer state (<= 2 more copies) + error feedback's residual (one more, in the
        # last state) + step + RNG state: a bound, not a guess
        copies = 4 if job.spec.communication.error_feedback else 3
        return r, expected, copies * job.model_size + (1 << 20)

    async def accept_state(self, r: StateRequestState, step: int, sha: str) -> None:
        """The state's blob is stored (durably): record it; the engine judges once all are in."""
        await self.store.record_state(r.id, step, sha)
        r.states[step] = sha
        if r.complete:
            self.rounds.poke(r.job_id)

    async def decline_states(self, node: NodeState, msg: StateUnavailable) -> str:
        """The node no longer holds some of the states it was asked for: recorded (durably), and
        the engine judges at once once every step is answered, rather than at the deadline."""
        r = self._open_request(node, msg.request_id)
        steps = set(msg.steps)
        if not steps:
            raise BadRequest("name at least one step the node no longer holds", code="bad_step")
        if not steps <= set(r.steps):
            raise BadRequest(f"steps {sorted(steps - set(r.steps))} were not requested "
                             f"(requested: {list(r.steps)})", code="bad_step")
        if handed := sorted(steps & r.states.keys()):
            raise Conflict(f"the states of steps {handed} were handed over already", code="handed_over")
        await self.store.decline_states(r.id, sorted(steps))
        r.declined |= steps
        if r.complete:
            self.rounds.poke(r.job_id)
        return f"{len(steps)} step(s) recorded as no longer held; the referee decides without them"
