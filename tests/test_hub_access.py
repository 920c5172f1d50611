"""Who may call what: EVERY route x role pair of the hub's API, from one table, over a real hub.

Roles: anonymous, the job's owner (alice), another owner (bob), an auditor, an admin, a
registered node holding a live assignment, and another registered node. An auditor reads
the evidence (flags, the audit log, nodes), never an owner's jobs or models. Node routes
open only with the node's own signature; a bearer token of any role opens none of them, and
a node's signature opens no bearer route.
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
import torch
from gpuflex.hub.server.appkeys import DB, LEDGER
from gpuflex.hub.server.openapi import openapi_document
from gpuflex.hub.storage.token_admin import create_token
from gpuflex.protocol.messages import (
    Abandon,
    Assignment,
    BlobRequest,
    Heartbeat,
    RelayHeader,
    RelayTake,
    SecAggKeys,
    SecAggMasked,
    SecAggPoll,
    SecAggShares,
    SecAggUnmask,
    SiloQuery,
    SiloRegistration,
    SiloWithdrawal,
    StateUnavailable,
    StateUpload,
    WorkRequest,
)
from gpuflex.protocol.signing import new_nonce, seal

from tests.helpers import RunningHub, SimNode, start_hub, store_for

ANON, OWNER, OTHER, AUDITOR, ADMIN, NODE, OTHER_NODE = (
    "anonymous", "owner", "other_owner", "auditor", "admin", "node", "other_node")
ROLES = (ANON, OWNER, OTHER, AUDITOR, ADMIN, NODE, OTHER_NODE)
TOKEN_ROLES = (OWNER, OTHER, AUDITOR, ADMIN)


def _all(expect: Any) -> dict[str, Any]:
    return dict.fromkeys(ROLES, expect)


def _bearer(*, anon: Any = (401, "missing_token"), owner: Any, other: Any, auditor: Any, admin: Any) -> dict[str, Any]:
    """A bearer route: a node's signature is no token (401 like anonymous)."""
    return {ANON: anon, OWNER: owner, OTHER: other, AUDITOR: auditor, ADMIN: admin,
            NODE: (401, "missing_token"), OTHER_NODE: (401, "missing_token")}


def _node(*, unsigned: Any, node: Any, other_node: Any) -> dict[str, Any]:
    """A node route: no bearer token opens it; only the node's own signature does."""
    return {**dict.fromkeys((ANON, *TOKEN_ROLES), unsigned), NODE: node, OTHER_NODE: other_node}


WRONG_ROLE = (403, "wrong_role")

# (method, route as the OpenAPI document names it): expected (status, error code | None) per role.
# "200+" marks a 2xx whose body is checked for scoping below.
TABLE: dict[tuple[str, str], dict[str, Any]] = {
    ("GET", "/healthz"): _all((200, None)),
    ("GET", "/metrics"): _all((200, None)),
    ("GET", "/v1/openapi.json"): _all((200, None)),
    ("GET", "/v1/hub"): _all((200, None)),
    ("POST", "/v1/nodes/register"): _node(unsigned=(400, "bad_message"), node=(200, None), other_node=(200, None)),
    ("POST", "/v1/work"): _node(unsigned=(400, "bad_message"), node=(200, None), other_node=(200, None)),
    ("POST", "/v1/heartbeat"): _node(unsigned=(400, "bad_message"), node=(200, None),
                                     other_node=(403, "not_your_assignment")),
    ("POST", "/v1/abandon"): _node(unsigned=(400, "bad_message"), node=(200, None),
                                   other_node=(403, "not_your_assignment")),
    ("GET", "/v1/blobs/{sha256}"): _node(unsigned=(401, "missing_auth"), node=(200, None),
                                         other_node=(403, "not_assigned")),
    # the world's jobs are in round 0: no earlier model to make a delta from
    ("GET", "/v1/blobs/{sha256}/from/{base}"): _node(unsigned=(401, "missing_auth"), node=(404, "no_delta"),
                                                     other_node=(403, "not_assigned")),
    ("POST", "/v1/updates"): _node(unsigned=(401, "missing_auth"), node=(200, None),
                                   other_node=(403, "not_your_assignment")),
    ("POST", "/v1/updates/offset"): _node(unsigned=(401, "missing_auth"), node=(200, None),
                                          other_node=(403, "not_your_assignment")),
    # no state request is open in this world: a signed upload names none (tests/test_hub_referee.py has
    # the open request that only its node may answer: 403 not_your_request for any other)
    ("POST", "/v1/states"): _node(unsigned=(401, "missing_auth"), node=(404, "unknown_request"),
                                  other_node=(404, "unknown_request")),
    ("POST", "/v1/states/unavailable"): _node(unsigned=(400, "bad_message"), node=(404, "unknown_request"),
                                              other_node=(404, "unknown_request")),
    # the world's jobs train on data uploaded to the hub: a silo for them is refused, to any node
    # (tests/test_silos.py has the node-local job)
    ("POST", "/v1/silos/schema"): _node(unsigned=(400, "bad_message"), node=(409, "not_node_local"),
                                        other_node=(409, "not_node_local")),
    ("POST", "/v1/silos"): _node(unsigned=(400, "bad_message"), node=(409, "not_node_local"),
                                 other_node=(409, "not_node_local")),
    ("POST", "/v1/silos/withdraw"): _node(unsigned=(400, "bad_message"), node=(409, "not_node_local"),
                                          other_node=(409, "not_node_local")),
    # ... and has no secure aggregation (tests/test_secagg.py runs one): the node's own live assignment
    # is refused with no_secagg, another node's is not its to name
    **{("POST", f"/v1/secagg/{step}"): _node(unsigned=(401, "missing_auth") if step == "masked" else
                                            (400, "bad_message"), node=(409, "no_secagg"),
                                            other_node=(403, "not_your_assignment"))
       for step in ("keys", "poll", "shares", "masked", "unmask")},
    # the pipeline relay: alice's job runs a 2-stage plan, the node stage 0, the other node stage 1
    # (tests/test_pipeline_relay.py has every refusal); a take finds nothing sent (204)
    ("POST", "/v1/relay"): _node(unsigned=(401, "missing_auth"), node=(200, None),
                                 other_node=(403, "not_your_stage")),
    ("GET", "/v1/relay"): _node(unsigned=(401, "missing_auth"), node=(403, "not_your_stage"),
                                other_node=(204, None)),
    # a pipelined job's stage nodes: the world's jobs are data-parallel, so none has a pipeline to
    # checkpoint or report to (tests/test_hub_pipeline.py has the pipelined job and every refusal)
    ("POST", "/v1/pipeline/checkpoint"): _node(unsigned=(401, "missing_auth"), node=(404, "unknown_job"),
                                               other_node=(404, "unknown_job")),
    ("POST", "/v1/pipeline/report"): _node(unsigned=(400, "bad_message"), node=(404, "unknown_job"),
                                           other_node=(404, "unknown_job")),
    # any registered node may have its link timed
    ("POST", "/v1/nodes/probe"): _node(unsigned=(401, "missing_auth"), node=(200, None), other_node=(200, None)),
    ("POST", "/v1/jobs"): _bearer(owner=(201, None), other=(201, None), auditor=WRONG_ROLE, admin=(201, None)),
    ("GET", "/v1/jobs"): _bearer(owner=(200, "sees"), other=(200, "blind"), auditor=WRONG_ROLE,
                                 admin=(200, "sees")),
    ("GET", "/v1/jobs/{job_id}"): _bearer(owner=(200, None), other=(404, "unknown_job"), auditor=WRONG_ROLE,
                                          admin=(200, None)),
    # the world's nodes offer no memory (no --max-memory): 200 with the one-line refusal
    ("GET", "/v1/jobs/{job_id}/plan"): _bearer(owner=(200, None), other=(404, "unknown_job"),
                                               auditor=WRONG_ROLE, admin=(200, None)),
    ("GET", "/v1/jobs/{job_id}/model"): _bearer(owner=(200, None), other=(404, "unknown_job"),
                                                auditor=WRONG_ROLE, admin=(200, None)),
    ("POST", "/v1/jobs/{job_id}/cancel"): _bearer(owner=(200, None), other=(404, "unknown_job"),
                                                  auditor=WRONG_ROLE, admin=(200, None)),
    # an empty body names no model to go back to (tests/test_rollback.py rolls a job back)
    ("POST", "/v1/jobs/{job_id}/rollback"): _bearer(owner=(400, "bad_rollback"), other=(404, "unknown_job"),
                                                    auditor=WRONG_ROLE, admin=(400, "bad_rollback")),
    ("GET", "/v1/flags"): _bearer(owner=(200, "sees"), other=(200, "blind"), auditor=(200, "sees"),
                                  admin=(200, "sees")),
    ("GET", "/v1/flags/{flag_id}"): _bearer(owner=(200, None), other=(404, "unknown_flag"),
                                            auditor=(200, None), admin=(200, None)),
    ("POST", "/v1/flags/{flag_id}/verdict"): _bearer(owner=WRONG_ROLE, other=WRONG_ROLE, auditor=(200, None),
                                                     admin=(200, None)),
    ("GET", "/v1/audit-log"): _bearer(owner=WRONG_ROLE, other=WRONG_ROLE, auditor=(200, None), admin=(200, None)),
    ("GET", "/v1/nodes"): _bearer(owner=WRONG_ROLE, other=WRONG_ROLE, auditor=(200, None), admin=(200, None)),
    # nothing of this world is banned: nothing cools down, so a lift finds nothing to lift
    ("GET", "/v1/cooldowns"): _bearer(owner=WRONG_ROLE, other=WRONG_ROLE, auditor=WRONG_ROLE, admin=(200, None)),
    ("POST", "/v1/cooldowns/lift"): _bearer(owner=WRONG_ROLE, other=WRONG_ROLE, auditor=WRONG_ROLE,
                                            admin=(409, "not_cooling")),
}

SPEC = """
[job]
name = "{name}"
[model]
kind = "mlp"
input = 8
hidden = [4]
outputs = 3
[train]
rounds = {rounds}
batch_size = 16
seed = 1
round_target_s = 86400.0
[data]
chunk_size = 16
split = "random"
[verification]
replication = 0.0
spot_check = 0.0
"""


def _train_npz() -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    np.savez(buf, x=rng.normal(size=(64, 8)).astype(np.float32), y=rng.integers(0, 3, 64))
    return buf.getvalue()


@dataclass
class World:
    hub: RunningHub
    session: aiohttp.ClientSession
    tokens: dict[str, str]
    job: str  # alice's running job (many rounds)
    doomed: str  # alice's job that cancel cells cancel
    flag: str  # a flag on alice's job
    node: SimNode
    other_node: SimNode
    assignment: Assignment | None = None
    flags_made: int = field(default=0)

    async def submit(self, token: str, name: str, rounds: int = 1000) -> aiohttp.ClientResponse:
        form = aiohttp.FormData()
        form.add_field("spec", SPEC.format(name=name, rounds=rounds).encode(), filename="spec.toml")
        form.add_field("train", _train_npz(), filename="train.npz")
        return await self.session.post(f"{self.hub.url}/v1/jobs", data=form,
                                       headers={"Authorization": f"Bearer {token}"})

    async def live_assignment(self) -> Assignment:
        """The node's live assignment; asks for a new one when the last was used up."""
        sched = self.hub.app[LEDGER].scheduler
        if self.assignment is not None and self.assignment.assignment_id in sched.assignments:
            return self.assignment
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            got = await self.node.work(0.5)
            if isinstance(got, Assignment):
                self.assignment = got
                return got
        raise AssertionError("the node got no assignment in 30 s")

    async def new_flag(self) -> str:
        self.flags_made += 1
        flag_id = f"f-access-{self.flags_made}"
        await self.hub.app[DB].write(lambda c: c.execute(
            "INSERT INTO flags (id, job_id, round, update_id, node_id, reason, evidence, created_at)"
            " VALUES (?, ?, 0, 'u-none', 'gf1-none-none-none-none-none', 'outlier', '{}', ?)",
            (flag_id, self.job, time.time())))
        return flag_id


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory):
    data = tmp_path_factory.mktemp("access")
    hub = await start_hub(data, long_poll_max_s=0.5)
    session = aiohttp.ClientSession()
    tokens = {OWNER: hub.owner_token, OTHER: create_token(data, "owner", "bob", store=store_for(data)),
              AUDITOR: hub.auditor_token, ADMIN: hub.admin_token}
    w = World(hub=hub, session=session, tokens=tokens, job="", doomed="", flag="",
              node=SimNode(session, hub.url), other_node=SimNode(session, hub.url))
    try:
        for attr, name in (("job", "alice-main"), ("doomed", "alice-doomed")):
            r = await w.submit(tokens[OWNER], name)
            assert r.status == 201, await r.text()
            setattr(w, attr, (await r.json())["id"])
        await w.node.register()
        await w.other_node.register()
        w.flag = await w.new_flag()
        await w.live_assignment()
        yield w
    finally:
        await session.close()
        await hub.stop()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode()


async def _node_request(w: World, route: tuple[str, str], role: str) -> dict[str, Any]:
    """A request to a node route as `role` would send it: only node roles can sign."""
    method, path = route
    signer = {NODE: w.node, OTHER_NODE: w.other_node}.get(role)
    a = await w.live_assignment()
    headers: dict[str, str] = {"Content-Type": "application/x-msgpack"}
    if role in TOKEN_ROLES:
        headers["Authorization"] = f"Bearer {w.tokens[role]}"
    now = time.time()
    if path == "/v1/blobs/{sha256}/from/{base}":
        sha = a.model_hash
        if signer is not None:
            headers["X-GPUFlex-Auth"] = _b64(seal(signer.key, BlobRequest(sha256=sha, timestamp=now,
                                                                          nonce=new_nonce())))
        return {"method": method, "path": f"/v1/blobs/{sha}/from/{'0' * 64}", "headers": headers}
    if path == "/v1/blobs/{sha256}":
        sha = a.chunks[0].sha256
        if signer is not None:
            headers["X-GPUFlex-Auth"] = _b64(seal(signer.key, BlobRequest(sha256=sha, timestamp=now,
                                                                          nonce=new_nonce())))
        return {"method": method, "path": f"/v1/blobs/{sha}", "headers": headers}
    if path == "/v1/states":
        if signer is not None:
            headers["X-GPUFlex-State"] = _b64(seal(signer.key, StateUpload(
                request_id="sr-none", step=0, state_sha256="0" * 64, state_size=4, timestamp=now,
                nonce=new_nonce())))
        headers["Content-Type"] = "application/octet-stream"
        return {"method": method, "path": path, "headers": headers, "data": b"\0" * 4}
    if path == "/v1/relay":
        return _relay_request(w, method, headers, signer, now)
    if path.startswith("/v1/pipeline/") or path == "/v1/nodes/probe":
        return _pipeline_request(w, path, headers, signer, now)
    if path == "/v1/secagg/masked":
        if signer is not None:
            headers["X-GPUFlex-Masked"] = _b64(seal(signer.key, SecAggMasked(
                assignment_id=a.assignment_id, sha256="0" * 64, size=8, sample_count=1, loss=0.1, train_s=0.1,
                timestamp=now, nonce=new_nonce())))
        headers["Content-Type"] = "application/octet-stream"
        return {"method": method, "path": path, "headers": headers, "data": b"\0" * 8}
    if path == "/v1/updates/offset":
        if signer is not None:
            blob = b"\0" * 4
            headers["X-GPUFlex-Update"] = _b64(seal(signer.key, w.node.update_header(a, blob, 1, 1.0)))
        headers["Content-Type"] = "application/octet-stream"
        return {"method": method, "path": path, "headers": headers, "data": b""}
    if path == "/v1/updates":
        node = signer or w.node
        blob, samples, loss = await w.node.train(a)
        if signer is not None:
            headers["X-GPUFlex-Update"] = _b64(seal(signer.key, node.update_header(a, blob, samples, loss)))
        headers["Content-Type"] = "application/octet-stream"
        return {"method": method, "path": path, "headers": headers, "data": blob}
    body = b""
    if signer is not None:
        if path == "/v1/nodes/register":
            body = seal(signer.key, signer.hello())
        elif path == "/v1/work":
            body = seal(signer.key, WorkRequest(timestamp=now, nonce=new_nonce(), wait_s=0.0, cached_chunks=()))
        elif path == "/v1/secagg/keys":
            body = seal(signer.key, SecAggKeys(assignment_id=a.assignment_id, c_pk=b"\x01" * 32, s_pk=b"\x02" * 32,
                                               timestamp=now, nonce=new_nonce()))
        elif path == "/v1/secagg/poll":
            body = seal(signer.key, SecAggPoll(assignment_id=a.assignment_id, timestamp=now, nonce=new_nonce()))
        elif path == "/v1/secagg/shares":
            body = seal(signer.key, SecAggShares(assignment_id=a.assignment_id, shares=(), timestamp=now,
                                                 nonce=new_nonce()))
        elif path == "/v1/secagg/unmask":
            body = seal(signer.key, SecAggUnmask(assignment_id=a.assignment_id, shares=(), timestamp=now,
                                                 nonce=new_nonce()))
        elif path == "/v1/silos/schema":
            body = seal(signer.key, SiloQuery(job_id=w.job, timestamp=now, nonce=new_nonce()))
        elif path == "/v1/silos/withdraw":
            body = seal(signer.key, SiloWithdrawal(job_id=w.job, sha256="0" * 64, timestamp=now, nonce=new_nonce()))
        elif path == "/v1/silos":
            body = seal(signer.key, SiloRegistration(job_id=w.job, sha256="0" * 64, size=48, samples=1,
                                                     timestamp=now, nonce=new_nonce()))
        elif path == "/v1/states/unavailable":
            body = seal(signer.key, StateUnavailable(request_id="sr-none", steps=(0,), reason="test", timestamp=now,
                                                     nonce=new_nonce()))
        elif path == "/v1/heartbeat":
            body = seal(signer.key, Heartbeat(assignment_id=a.assignment_id, progress=0.5, timestamp=now,
                                              nonce=new_nonce()))
        else:
            body = seal(signer.key, Abandon(assignment_id=a.assignment_id, reason="test", timestamp=now,
                                            nonce=new_nonce()))
    return {"method": method, "path": path, "headers": headers, "data": body}


def _relay_request(w: World, method: str, headers: dict[str, str], signer: SimNode | None,
                   now: float) -> dict[str, Any]:
    from gpuflex.hub.model.relay import Crossing, RelayPlan
    from gpuflex.hub.server.appkeys import RELAY
    from gpuflex.protocol.tensors import encode_state

    w.hub.app[RELAY].registry.assign(w.job, RelayPlan(stages=(w.node.node_id, w.other_node.node_id),
                                                      boundaries=(Crossing("float32", (2, 3)),), micro_batches=1))
    step = int(now * 1000) % (1 << 30)  # a fresh message each time
    if method == "GET":
        if signer is not None:
            headers["X-GPUFlex-Auth"] = _b64(seal(signer.key, RelayTake(
                job_id=w.job, step=step, micro_batch=0, carries="activation", stage=0, to_stage=1, wait_s=0.0,
                timestamp=now, nonce=new_nonce())))
        return {"method": method, "path": "/v1/relay", "headers": headers}
    body = encode_state({"activation": torch.zeros(2, 3)})
    if signer is not None:
        headers["X-GPUFlex-Relay"] = _b64(seal(signer.key, RelayHeader(
            job_id=w.job, step=step, micro_batch=0, carries="activation", stage=0, to_stage=1,
            sha256=hashlib.sha256(body).hexdigest(), size=len(body), timestamp=now, nonce=new_nonce())))
    headers["Content-Type"] = "application/octet-stream"
    return {"method": method, "path": "/v1/relay", "headers": headers, "data": body}


def _pipeline_request(w: World, path: str, headers: dict[str, str], signer: SimNode | None,
                      now: float) -> dict[str, Any]:
    from gpuflex.protocol.messages import LinkProbe, StageReport, UnitCheckpoint

    if path == "/v1/pipeline/report":
        body = b"" if signer is None else seal(signer.key, StageReport(
            job_id=w.job, generation=1, stage=0, steps_done=1, step_s=0.1, compute_s=0.1, loss=None, failed="",
            timestamp=now, nonce=new_nonce()))
        return {"method": "POST", "path": path, "headers": headers, "data": body}
    data = b"\0" * 8
    if path == "/v1/nodes/probe":
        if signer is not None:
            headers["X-GPUFlex-Auth"] = _b64(seal(signer.key, LinkProbe(
                sha256=hashlib.sha256(data).hexdigest(), size=len(data), timestamp=now, nonce=new_nonce())))
        headers["Content-Type"] = "application/octet-stream"
        return {"method": "POST", "path": path, "headers": headers, "data": data}
    if signer is not None:
        headers["X-GPUFlex-Auth"] = _b64(seal(signer.key, UnitCheckpoint(
            job_id=w.job, generation=1, stage=0, unit=0, step=1, sha256=hashlib.sha256(data).hexdigest(),
            size=len(data), timestamp=now, nonce=new_nonce())))
    headers["Content-Type"] = "application/octet-stream"
    return {"method": "POST", "path": path, "headers": headers, "data": data}


async def _bearer_request(w: World, route: tuple[str, str], role: str) -> dict[str, Any]:
    method, path = route
    headers: dict[str, str] = {}
    if role in TOKEN_ROLES:
        headers["Authorization"] = f"Bearer {w.tokens[role]}"
    elif role in (NODE, OTHER_NODE):  # a node's signature where a token is needed
        signer = w.node if role == NODE else w.other_node
        headers["X-GPUFlex-Auth"] = _b64(seal(signer.key, BlobRequest(sha256="0" * 64, timestamp=time.time(),
                                                                      nonce=new_nonce())))
    kw: dict[str, Any] = {"method": method, "headers": headers}
    if path == "/v1/jobs" and method == "POST":
        form = aiohttp.FormData()
        form.add_field("spec", SPEC.format(name=f"by-{role}", rounds=1).encode(), filename="spec.toml")
        form.add_field("train", _train_npz(), filename="train.npz")
        kw["data"] = form
    if path == "/v1/cooldowns/lift":
        kw["json"] = {"address": "203.0.113.7", "note": f"access test, {role}"}
    if path.endswith("/verdict"):
        kw["json"] = {"verdict": "dismiss", "note": f"access test, {role}"}
        path = path.replace("{flag_id}", await w.new_flag())
    job = w.doomed if path.endswith("/cancel") else w.job
    kw["path"] = path.replace("{job_id}", job).replace("{flag_id}", w.flag)
    return kw


async def _give_back(w: World, sealed: bytes) -> None:
    from gpuflex.protocol.messages import peek_kind
    from gpuflex.protocol.signing import open_envelope, open_sealed

    payload, _, _ = open_envelope(sealed)
    if peek_kind(payload) == Assignment.KIND:
        got, _ = open_sealed(sealed, Assignment)
        async with await w.other_node.abandon(got.assignment_id) as r:
            assert r.status == 200


def _check_scope(route: tuple[str, str], role: str, what: str, body: Any, w: World) -> None:
    """"sees": alice's job or flag is listed; "blind": it is not (another owner)."""
    if route[1] == "/v1/jobs":
        ids = {j["id"] for j in body["jobs"]}
        assert (w.job in ids) == (what == "sees"), (role, ids)
        if role == OTHER:
            assert all(j["owner"] == "bob" for j in body["jobs"])
    else:
        ids = {f["id"] for f in body["flags"]}
        assert (w.flag in ids) == (what == "sees"), (role, ids)
        if role == OTHER:
            assert ids == set()


CELLS = [(route, role) for route in TABLE for role in ROLES]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("route", "role"), CELLS, ids=[f"{m} {p} as {r}" for (m, p), r in CELLS])
async def test_route_by_role(world: World, route: tuple[str, str], role: str) -> None:
    status, detail = TABLE[route][role]
    builder = _node_request if any(route[1].startswith(p) for p in (
        "/v1/nodes/register", "/v1/work", "/v1/heartbeat", "/v1/abandon", "/v1/blobs", "/v1/updates",
        "/v1/states", "/v1/silos", "/v1/secagg", "/v1/relay", "/v1/pipeline", "/v1/nodes/probe")) \
        else _bearer_request
    kw = await builder(world, route, role)
    path = kw.pop("path")
    method = kw.pop("method")
    async with world.session.request(method, world.hub.url + path, **kw) as r:
        raw = await r.read()
        got = r.status
        ctype = r.headers.get("Content-Type", "")
    if route == ("POST", "/v1/work") and role == OTHER_NODE and got == 200:
        await _give_back(world, raw)  # the other node must hold nothing of the node's
    assert got == status, (method, path, role, raw[:300])
    if got >= 400:
        import json

        doc = json.loads(raw)
        assert set(doc) == {"error", "detail"} and doc["error"] == detail, doc
    elif detail in ("sees", "blind"):
        import json

        _check_scope(route, role, detail, json.loads(raw), world)
    elif route[1] == "/v1/jobs/{job_id}/model":
        assert ctype == "application/octet-stream" and raw


def test_the_table_covers_every_documented_route_and_the_api_reference_agrees():
    documented = {(m.upper(), p) for p, ops in openapi_document()["paths"].items() for m in ops}
    assert documented == set(TABLE)
    from pathlib import Path

    api = (Path(__file__).resolve().parent.parent / "docs" / "http-api.md").read_text()  # the HTTP API reference
    row = next(line for line in api.splitlines() if line.startswith("| `GET /v1/jobs`"))
    assert "auditor" not in row.split("|")[2]
    model_row = next(line for line in api.splitlines() if line.startswith("| `GET /v1/jobs/{id}/model"))
    assert "auditor" not in model_row.split("|")[2]
    docs = openapi_document()["paths"]
    for p in ("/v1/jobs/{job_id}", "/v1/jobs/{job_id}/model", "/v1/jobs/{job_id}/plan"):
        assert "403" in docs[p]["get"]["responses"], p
