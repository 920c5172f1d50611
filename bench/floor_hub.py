"""The least a hub must do for hub_load's nodes: the protocol's floor in that harness.

hub_load's signed echoes measure the least work per request, driven by a client that only
sends. A round of the real protocol is more than that: each node's poll waits for the round,
its assignment is signed for it, the node signs an update header for that assignment, and the
update's bytes are checked and stored before the ack. This server does exactly that much for
the same simulated nodes (bench/hub_load.py's Node), with the product's own code, and nothing
else: no scheduler, no ledger, no verification, no aggregation. A round opens the moment its
last update is durable (a close that costs nothing).

Per request, as the hub must:
- register: the Hello's Ed25519 signature and freshness (protocol/signing.py), the node committed
  (hub/storage/db.py's group commit) before its signed Welcome;
- work: the WorkRequest's signature and freshness; a long-poll until the round opens; a signed
  Assignment, committed before it is sent;
- update: the header's signature and freshness, the assignment's owner and round, the bytes' size
  and SHA-256, protocol.tensors.check_blob against the model (manifest, finiteness), then the blob and
  its row in one commit (the hub's pack and store are two) before the signed Ack.

Usage: python bench/floor_hub.py PORT DATA_DIR ROUNDS   (writes DATA_DIR/hub.url once serving)
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import secrets
import sys
import time
from pathlib import Path

from aiohttp import web
from gpuflex.hub.storage.db import Database, durable_connection
from gpuflex.protocol.messages import (
    Ack,
    Assignment,
    ChunkRef,
    Hello,
    NoWork,
    TrainConfig,
    UpdateHeader,
    Welcome,
    WorkRequest,
)
from gpuflex.protocol.modelspec import ModelSpec, build_model
from gpuflex.protocol.signing import ReplayGuard, SigningKey, fingerprint, open_sealed, seal
from gpuflex.protocol.tensors import check_blob, encode_state, manifest_of, sha256_hex

#: hub_load's model (its SPEC): what every update must match
MODEL = {"kind": "mlp", "input": 8, "hidden": [16], "outputs": 2}
SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (id TEXT PRIMARY KEY, public_key BLOB NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS assignments (id TEXT PRIMARY KEY, node_id TEXT NOT NULL, round INTEGER NOT NULL,
                                        sealed BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS blobs (sha TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS updates (assignment_id TEXT PRIMARY KEY, sha TEXT NOT NULL, samples INTEGER NOT NULL);
"""
MSGPACK = "application/x-msgpack"


class Floor:
    def __init__(self, data: Path, rounds: int) -> None:
        self.key = SigningKey.generate()
        self.replay = ReplayGuard()
        self.db = Database(data / "floor.sqlite3", opener=durable_connection)  # WAL, synchronous=FULL
        for statement in SCHEMA.split(";")[:-1]:
            self.db.write_sync(lambda c, sql=statement: c.execute(sql))
        model = build_model(ModelSpec.from_dict(MODEL), seed=0)
        self.manifest = manifest_of(model.state_dict())
        blob = encode_state(model.state_dict())
        self.model_hash, self.model_size = sha256_hex(blob), len(blob)
        self.rounds = rounds
        self.round = -1  # no job yet
        self.opened: list[float] = []
        self.opening = asyncio.Event()
        self.nodes: dict[bytes, str] = {}  # public key -> node id
        self.assigned: dict[str, int] = {}  # node id -> the last round it was assigned
        self.live: dict[str, tuple[str, int]] = {}  # assignment id -> (node id, round)
        self.uploaded = 0
        self.train = TrainConfig(local_epochs=1, batch_size=4, optimizer="sgd", lr=0.1, momentum=0.0,
                                 weight_decay=0.0, beta1=0.9, beta2=0.999, loss="cross_entropy", grad_clip=0.0,
                                 commit=False)

    def open_round(self) -> None:
        self.round += 1
        self.uploaded = 0
        self.opened.append(time.time())
        self.opening.set()
        self.opening = asyncio.Event()

    def node(self, signer: bytes) -> str:
        node_id = self.nodes.get(signer)
        if node_id is None:
            raise web.HTTPForbidden(text="unknown node")
        return node_id

    async def register(self, request: web.Request) -> web.Response:
        hello, signer = open_sealed(await request.read(), Hello)
        self.replay.check(signer, hello.timestamp, hello.nonce)
        node_id = self.nodes.get(signer) or "n-" + secrets.token_hex(8)
        now = time.time()
        await self.db.write(lambda c: c.execute("INSERT OR IGNORE INTO nodes VALUES (?, ?, ?)", (node_id, signer, now)))
        self.nodes[signer] = node_id
        return web.Response(body=seal(self.key, Welcome(node_id=node_id, hub_fingerprint=fingerprint(self.key.public_bytes),
                                                        server_time=now, poll_s=5.0)), content_type=MSGPACK)

    async def work(self, request: web.Request) -> web.Response:
        req, signer = open_sealed(await request.read(), WorkRequest)
        self.replay.check(signer, req.timestamp, req.nonce)
        node_id = self.node(signer)
        give_up = time.monotonic() + min(req.wait_s, 30.0)
        while 0 <= self.round < self.rounds and self.assigned.get(node_id, -1) >= self.round:
            left = give_up - time.monotonic()  # this round's work is taken: wait for the next one
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self.opening.wait(), left)
            except TimeoutError:
                break
        if not 0 <= self.round < self.rounds or self.assigned.get(node_id, -1) >= self.round:
            return web.Response(body=seal(self.key, NoWork(retry_after_s=1.0, reason="no work")), content_type=MSGPACK)
        now, rnd = time.time(), self.round
        aid = "a-" + secrets.token_hex(8)
        sealed = seal(self.key, Assignment(
            assignment_id=aid, job_id="j-floor", round=rnd, node_id=node_id, model_hash=self.model_hash,
            model_size=self.model_size, model_spec=MODEL,
            chunks=(ChunkRef(sha256=hashlib.sha256(aid.encode()).hexdigest(), size=160, samples=4),),
            seed=rnd, train=self.train, issued_at=now, deadline=now + 120.0, replica_group=""))
        self.assigned[node_id] = rnd  # before the write: a second poll of this node cannot take another
        await self.db.write(lambda c: c.execute("INSERT INTO assignments VALUES (?, ?, ?, ?)",
                                                (aid, node_id, rnd, sealed)))
        self.live[aid] = (node_id, rnd)
        return web.Response(body=sealed, content_type=MSGPACK)

    async def update(self, request: web.Request) -> web.Response:
        hdr, signer = open_sealed(base64.urlsafe_b64decode(request.headers["X-GPUFlex-Update"]), UpdateHeader)
        self.replay.check(signer, hdr.timestamp, hdr.nonce)
        node_id = self.node(signer)
        owner = self.live.pop(hdr.assignment_id, None)
        if owner is None or owner != (node_id, self.round):
            raise web.HTTPConflict(text="not a live assignment of this node")
        body = await request.read()
        if len(body) != hdr.update_size or hashlib.sha256(body).hexdigest() != hdr.update_sha256:
            raise web.HTTPUnprocessableEntity(text="update bytes do not match the header")
        if check_blob(body, self.manifest) is not None:
            raise web.HTTPUnprocessableEntity(text="update holds NaN or infinity")

        def store(c):  # type: ignore[no-untyped-def]
            c.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?)", (hdr.update_sha256, body))
            c.execute("INSERT INTO updates VALUES (?, ?, ?)", (hdr.assignment_id, hdr.update_sha256, hdr.sample_count))

        await self.db.write(store)
        self.uploaded += 1
        if self.uploaded == len(self.nodes):  # the round's last update: the next round opens
            self.open_round()
        return web.Response(body=seal(self.key, Ack(ok=True, detail="accepted", deadline=0.0)), content_type=MSGPACK)

    async def submit(self, request: web.Request) -> web.Response:
        await request.read()
        if self.round < 0:
            self.open_round()
        return web.json_response({"id": "j-floor"}, status=201)

    async def job(self, request: web.Request) -> web.Response:
        state = "done" if self.round >= self.rounds else "running"
        return web.json_response({"state": state, "history": [{"round": r, "opened_at": t}
                                                              for r, t in enumerate(self.opened)]})


def main() -> None:
    port, data, rounds = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    data.mkdir(parents=True, exist_ok=True)
    floor = Floor(data, rounds)
    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/v1/nodes/register", floor.register)
    app.router.add_post("/v1/work", floor.work)
    app.router.add_post("/v1/updates", floor.update)
    app.router.add_post("/v1/jobs", floor.submit)
    app.router.add_get("/v1/jobs/{id}", floor.job)

    async def announce(_: web.Application) -> None:
        (data / "hub.url").write_text(f"http://127.0.0.1:{port}\n")

    app.on_startup.append(announce)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    main()
