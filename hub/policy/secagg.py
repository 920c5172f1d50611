"""A round's secure aggregation, the hub's side: who is in, which step it is at, and the sum.

``[privacy] secure_aggregation = true`` (a node-local job). The cryptography is
protocol/secagg.py's (Bonawitz et al. 2017, as SecAgg+ runs it); this module runs the server's
part of it over the round's silo nodes, one step at a time. A node that trained its silo:

1. ``keys``: sends its two public keys (POST /v1/secagg/keys);
2. ``shares``: once the roster is fixed, sends every other member its Shamir shares (of its
   self-mask seed and of its mask key), each encrypted to that member: the hub only forwards them;
3. ``masked``: once the survivors are known (who shared), receives the shares sent to it and
   uploads its update, weighted, clipped, quantized and masked (POST /v1/secagg/masked);
4. ``unmask``: once the masked updates are in, hands over the shares the hub needs: of the
   self-mask seed of every node whose masked update came, of the mask key of every node that
   shared and then dropped out (never both for one node: protocol/secagg.py refuses);
5. ``done``: the hub removed the masks and has the SUM of the updates that came, and nothing else.

Each step ends when every member expected at it has answered (the roster: every silo whose
node is online), or once it has waited long enough with enough answers: the roster
``round_deadline_s`` from the round's opening (the nodes train first) with the job's quorum, the
later steps ``secagg_phase_s`` each with the reconstruction threshold (a majority of the roster). A step that times out short of that
aborts the round's aggregation: the round closes with the model unchanged (its masked updates
excluded) and the next round starts. What the hub keeps is in memory only: a hub restarted
during the protocol aborts that round the same way (the nodes are told, and train the next).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import RosterMember, Sealed, SecAggState, UnmaskShare
from gpuflex.protocol.secagg import RosterEntry, SecAggServer, dequantize_sum, threshold_for

from ..base.errors import Conflict, Unprocessable


@dataclass
class Member:
    node_id: str
    assignment_id: str
    c_pk: bytes
    s_pk: bytes
    shares: dict[str, bytes] | None = None  # receiver -> ciphertext (what it sent)
    masked: bool = False
    unmasked: bool = False


@dataclass
class SecAggRound:
    job_id: str
    round: int
    #: masked coordinates: the model's floating elements and the weight
    length: int
    quorum: int
    phase_s: float
    clip: float
    bits: int
    #: how long the roster waits for keys: the nodes train first (the round's deadline)
    keys_s: float = 300.0
    phase: str = "keys"
    phase_at: float = field(default_factory=time.time)
    members: dict[str, Member] = field(default_factory=dict)
    roster: list[str] = field(default_factory=list)
    threshold: int = 0
    survivors: list[str] = field(default_factory=list)
    alive: list[str] = field(default_factory=list)
    detail: str = ""
    _server: SecAggServer | None = None
    #: the unmasked sum: the weighted updates' sum and the weights' sum (once ``done``)
    total: np.ndarray | None = None

    # -- what nodes send ------------------------------------------------------------------------
    def member(self, node_id: str, assignment_id: str) -> Member:
        m = self.members.get(node_id)
        if m is None or m.assignment_id != assignment_id:
            raise Conflict("this assignment is not in the round's secure aggregation", code="not_a_member")
        return m

    def add_keys(self, node_id: str, assignment_id: str, c_pk: bytes, s_pk: bytes) -> None:
        m = self.members.get(node_id)
        if m is not None and (m.assignment_id, m.c_pk, m.s_pk) == (assignment_id, c_pk, s_pk):
            return  # the same keys again (a retry)
        if self.phase != "keys" or m is not None:
            raise Conflict(f"the round's secure aggregation is past its keys ({self.phase})", code="secagg_phase")
        if c_pk == s_pk or any(c_pk in (o.c_pk, o.s_pk) or s_pk in (o.c_pk, o.s_pk) for o in self.members.values()):
            raise Unprocessable("secure aggregation keys must be fresh for each round and node", code="bad_keys")
        self.members[node_id] = Member(node_id, assignment_id, c_pk, s_pk)

    def add_shares(self, node_id: str, assignment_id: str, shares: Sequence[Sealed]) -> None:
        m = self.member(node_id, assignment_id)
        if self.phase != "shares" or node_id not in self.roster:
            raise Conflict(f"the round's secure aggregation is not taking shares ({self.phase})", code="secagg_phase")
        got = {s.node_id: s.ciphertext for s in shares}
        want = set(self.roster) - {node_id}
        if len(got) != len(shares) or set(got) != want:
            raise Unprocessable(f"send exactly one share to each of the {len(want)} other members of the roster",
                                code="bad_shares")
        if m.shares is not None and m.shares != got:
            raise Conflict("this node's shares are in already", code="secagg_phase")
        m.shares = got

    def may_mask(self, node_id: str, assignment_id: str, size: int) -> Member:
        m = self.member(node_id, assignment_id)
        if self.phase != "masked" or node_id not in self.survivors:
            raise Conflict(f"the round's secure aggregation is not taking masked updates ({self.phase})",
                           code="secagg_phase")
        if m.masked:
            raise Conflict("this node's masked update is in already", code="secagg_phase")
        if size != 4 * self.length:
            raise Unprocessable(f"a masked update is {4 * self.length} bytes (uint32 x {self.length}), not {size}",
                                code="bad_masked")
        return m

    def add_masked(self, node_id: str, assignment_id: str, vector: np.ndarray) -> None:
        m = self.may_mask(node_id, assignment_id, int(vector.size) * 4)
        self._cryptography().add_masked(node_id, vector)
        m.masked = True

    def add_unmask(self, node_id: str, assignment_id: str, shares: Sequence[UnmaskShare]) -> None:
        m = self.member(node_id, assignment_id)
        if self.phase != "unmask" or node_id not in self.alive:
            raise Conflict(f"the round's secure aggregation is not unmasking ({self.phase})", code="secagg_phase")
        if m.unmasked:
            return
        try:
            self._cryptography().add_unmask(node_id, {s.node_id: (s.kind, s.share) for s in shares})
        except ProtocolError as exc:
            raise Unprocessable(f"unmask shares refused: {exc}", code="bad_shares") from None
        m.unmasked = True

    # -- what a node is told --------------------------------------------------------------------
    def state_for(self, node_id: str, assignment_id: str) -> SecAggState:
        m = self.members.get(node_id)
        if m is None or m.assignment_id != assignment_id:
            phase = "keys" if self.phase == "keys" else "aborted"
            detail = "" if phase == "keys" else self.detail or "this node is not in the round's secure aggregation"
            return SecAggState(assignment_id=assignment_id, phase=phase, detail=detail)
        roster = tuple(RosterMember(n, self.members[n].c_pk, self.members[n].s_pk) for n in self.roster)
        if self.phase in ("keys", "aborted", "done") or (self.phase != "shares" and node_id not in self.survivors):
            left_out = self.phase not in ("keys", "aborted", "done")
            return SecAggState(assignment_id=assignment_id, phase="aborted" if left_out else self.phase,
                               detail="this node's shares did not come in time" if left_out else self.detail)
        if self.phase == "shares":
            if node_id not in self.roster:
                return SecAggState(assignment_id=assignment_id, phase="aborted",
                                   detail="this node's keys came after the roster was fixed")
            return SecAggState(assignment_id=assignment_id, phase="shares", roster=roster, threshold=self.threshold)
        inbox = tuple(Sealed(sender, ct) for sender in self.survivors if sender != node_id
                      and (ct := (self.members[sender].shares or {}).get(node_id)) is not None)
        if self.phase == "masked":
            return SecAggState(assignment_id=assignment_id, phase="masked", roster=roster, threshold=self.threshold,
                               survivors=tuple(self.survivors), inbox=inbox)
        if node_id not in self.alive:
            return SecAggState(assignment_id=assignment_id, phase="aborted",
                               detail="this node's masked update did not come in time")
        return SecAggState(assignment_id=assignment_id, phase="unmask", roster=roster, threshold=self.threshold,
                           survivors=tuple(self.survivors), inbox=inbox, alive=tuple(self.alive),
                           dropped=tuple(n for n in self.survivors if n not in self.alive))

    # -- driving ----------------------------------------------------------------------------------
    def advance(self, now: float, expected: Collection[str]) -> bool:
        """Move on where a step is complete (or timed out); True when the phase changed."""
        before = self.phase
        late = now - self.phase_at >= (self.keys_s if self.phase == "keys" else self.phase_s)
        if self.phase == "keys":
            have = set(self.members)
            if len(have) >= max(3, self.quorum) and (late or set(expected) <= have):
                self.roster = sorted(have)
                self.threshold = threshold_for(len(self.roster))
                self._server = SecAggServer(self.job_id, self.round, [
                    RosterEntry(n, self.members[n].c_pk, self.members[n].s_pk) for n in self.roster],
                    self.threshold, self.length)
                self._next("shares", now)
        elif self.phase == "shares":
            sent = [n for n in self.roster if self.members[n].shares is not None]
            if len(sent) == len(self.roster) or late:
                if len(sent) < self.threshold:
                    self.abort(f"{len(sent)} of {len(self.roster)} members sent their shares in time; "
                               f"unmasking needs {self.threshold}")
                else:
                    self.survivors = sent
                    self._next("masked", now)
        elif self.phase == "masked":
            came = [n for n in self.survivors if self.members[n].masked]
            if len(came) == len(self.survivors) or late:
                if len(came) < self.threshold:
                    self.abort(f"{len(came)} of {len(self.survivors)} masked updates came in time; "
                               f"unmasking needs {self.threshold}")
                else:
                    self.alive = came
                    self._next("unmask", now)
        elif self.phase == "unmask":
            answered = [n for n in self.alive if self.members[n].unmasked]
            if len(answered) == len(self.alive) or (late and len(answered) >= self.threshold):
                self._finish(now)
            elif late:
                self.abort(f"{len(answered)} of {len(self.alive)} members handed over their unmask shares in "
                           f"time; unmasking needs {self.threshold}")
        return self.phase != before

    def _next(self, phase: str, now: float) -> None:
        self.phase = phase
        self.phase_at = now

    def _cryptography(self) -> SecAggServer:
        """The protocol's server side, which exists from the roster on (until an abort)."""
        if self._server is None:
            raise Conflict(f"the round's secure aggregation has no roster ({self.phase})", code="secagg_phase")
        return self._server

    def _finish(self, now: float) -> None:
        try:
            self.total = self._cryptography().result(self.survivors, self.alive)
        except ProtocolError as exc:
            self.abort(f"unmasking failed: {exc}")
            return
        self._next("done", now)

    def abort(self, why: str) -> None:
        self.phase = "aborted"
        self.detail = why.splitlines()[0][:250]
        self._server = None

    @property
    def settled(self) -> bool:
        return self.phase in ("done", "aborted")

    def mean_update(self) -> tuple[np.ndarray, float]:
        """The weighted mean of the updates that came (float64, the model's floating elements in
        manifest order) and the weights' sum: the sum dequantized, divided by the weights."""
        if self.total is None:
            raise RuntimeError("secure aggregation has no sum yet")
        total = dequantize_sum(self.total, len(self.alive), self.clip, self.bits)
        weight = float(total[-1])
        if not math.isfinite(weight) or weight <= 0:
            raise Unprocessable("secure aggregation summed no weight", code="bad_masked")
        return total[:-1] / weight, weight


def secagg_length(float_elements: int) -> int:
    """Masked coordinates of a model with ``float_elements`` floating elements: those and the weight."""
    return float_elements + 1
