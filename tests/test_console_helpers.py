"""Support for the console tests (no tests here): a cookie-keeping client that
logs in like a browser, and a small real job with a misbehaving node. The hub's
create_app mounts the console itself (gpuflex.hub.server.console.setup_console).

The job runs on the real wire: nodes sign with gpuflex.protocol, train with the
node's real trainer (gpuflex.node.trainer via tests/tooling/attacks.contribute)
and one of them uploads a sign-flipped update (tests/tooling/attacks.py). The
steps are driven one at a time so which node holds which shard is deterministic.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch
from gpuflex.protocol.messages import Assignment, ComputeClass, DeviceInfo, NoWork
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.tensors import decode_state, encode_state

from tests.helpers import RunningHub, SimNode, digits_spec, submit_job, write_digits

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
EVIL_NAME = "<script>alert('pwned')</script>"


class Browserish:
    """An aiohttp session that keeps cookies and logs in through the login form."""

    def __init__(self, url: str) -> None:
        self.url = url
        # unsafe=True: keep cookies for an IP address host (127.0.0.1)
        self.session = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))

    async def close(self) -> None:
        await self.session.close()

    async def get(self, path: str, **kw: Any) -> tuple[int, str, aiohttp.ClientResponse]:
        kw.setdefault("allow_redirects", False)
        async with self.session.get(self.url + path, **kw) as r:
            return r.status, await r.text(), r

    async def post(
        self, path: str, data: dict[str, str], *, origin: bool = True, **kw: Any
    ) -> tuple[int, str, aiohttp.ClientResponse]:
        headers = kw.pop("headers", {})
        if origin:
            headers.setdefault("Origin", self.url)
        async with self.session.post(
            self.url + path, data=data, headers=headers, allow_redirects=False, **kw
        ) as r:
            return r.status, await r.text(), r

    @staticmethod
    def csrf_in(html: str) -> str:
        m = re.search(r'name="csrf_token" value="([^"]+)"', html)
        assert m, "no CSRF field in the page"
        return m.group(1)

    async def login(self, token: str) -> aiohttp.ClientResponse:
        status, html, _ = await self.get("/console/login")
        assert status == 200, html
        status, body, r = await self.post(
            "/console/login",
            {"csrf_token": self.csrf_in(html), "token": token, "next": "/console/jobs"},
        )
        assert status == 303, (status, body[:500])
        return r

    async def page_csrf(self, path: str = "/console/jobs") -> str:
        status, html, _ = await self.get(path)
        assert status == 200, html[:500]
        return self.csrf_in(html)

    async def crawl(self, start: str = "/console/", limit: int = 400) -> dict[str, int]:
        """Follow every console link on every page reachable from ``start`` (redirects followed,
        fragments dropped): each link's final status, by the link as the page gave it."""
        seen: dict[str, int] = {}
        todo = [start]
        while todo and len(seen) < limit:
            path = todo.pop()
            if path in seen:
                continue
            async with self.session.get(self.url + path) as r:
                seen[path] = r.status if r.url.path != "/console/login" else 401
                if r.status != 200 or r.content_type != "text/html":
                    continue
                html = await r.text()
            for href in re.findall(r'href="(/console/[^"#]*)', html):
                link = href.replace("&amp;", "&")
                if link not in seen and not link.startswith("/console/static/"):
                    todo.append(link)
        return seen


# --------------------------------------------------------------------------- the job


class TrainingNode(SimNode):
    """SimNode that reports its real training time, optionally misbehaving.

    Training is gpuflex.node.trainer via tests/tooling/attacks.contribute (honest
    when attack is None)."""

    def __init__(self, *args: Any, attack: str | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        from tests.tooling.attacks import make_attack

        self.attack = make_attack(attack) if attack else None
        self.last_train_s = 0.01

    async def train(self, a: Assignment) -> tuple[bytes, int, float]:
        from tests.tooling.attacks import contribute

        torch.set_num_threads(1)
        global_state = decode_state(bytearray(await self.blob(a.model_hash)))
        chunks = [decode_state(bytearray(await self.blob(c.sha256))) for c in a.chunks]
        recorder = self.recorder(a, chunks)  # committed to the training that ran, whatever it then sends
        res = contribute(
            self.attack,
            ModelSpec.from_dict(a.model_spec),
            global_state,
            chunks,
            a.train,
            a.seed,
            device=torch.device("cpu"),
            on_step=recorder,
        )
        self.keep_commitment(a, recorder)
        self.last_train_s = max(float(res.train_s), 1e-3)
        return encode_state(res.delta), res.sample_count, res.loss

    def update_header(
        self, a: Assignment, blob: bytes, samples: int, loss: float, **over: Any
    ) -> Any:
        over.setdefault("timings", {"train_s": self.last_train_s})
        return super().update_header(a, blob, samples, loss, **over)


# Machines as real nodes describe them (long device names, class keys without spaces).
EPYC = ComputeClass("cpu", "AMD EPYC 9654 96-Core Processor", "", "AuthenticAMD",
                    ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "fma"), "2.13.0+cpu", "", "", True, 8,
                    ("fp32", "bf16"))
A100 = ComputeClass("cuda", "NVIDIA A100-SXM4-80GB", "8.0", "GenuineIntel", ("avx2",), "2.13.0+cu128", "12.8",
                    "91002", True, 8, ("fp32", "tf32", "bf16", "fp16"))
MACHINES = (
    (EPYC, DeviceInfo(kind="cpu", name="AMD EPYC 9654 96-Core Processor", memory_bytes=384 << 30, threads=8)),
    (A100, DeviceInfo(kind="cuda", name="NVIDIA A100-SXM4-80GB", memory_bytes=80 << 30, threads=8)),
)


class MachineNode(TrainingNode):
    """A TrainingNode whose hello describes one of MACHINES (it still trains on this CPU)."""

    def __init__(self, *args: Any, machine: int = 0, **kw: Any) -> None:
        compute, self.device = MACHINES[machine % len(MACHINES)]
        super().__init__(*args, compute=compute, **kw)

    def hello(self, **over: Any) -> Any:
        over.setdefault("device", self.device)
        return super().hello(**over)


@dataclass
class Scenario:
    job_id: str
    other_job_id: str
    attacker: str
    honest: list[str]


async def job_doc(s: aiohttp.ClientSession, hub: RunningHub, job_id: str) -> dict[str, Any]:
    async with s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth(hub.admin_token)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def run_job_with_attacker(
    hub: RunningHub,
    work_dir: Path,
    *,
    other_owner_token: str,
    rounds: int = 3,
    timeout: float = 45.0,
) -> Scenario:
    """alice's digits job trained by two honest nodes and one sign-flipping node
    (which contributes to the first shard only, then leaves); plus a job of
    another owner, named like a script tag, that nobody trains."""
    train, val, _ = write_digits(work_dir)
    # ~1000 samples per shard at the claimed throughput: two shards in the first round.
    spec = digits_spec(
        rounds=rounds, round_target_s=0.2, chunk_size=64, replication='"adaptive"', replica_wait_s=5.0
    )
    evil = digits_spec(rounds=1).replace('name = "digits-mlp"', f'name = "{EVIL_NAME}"')
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, spec, train, val)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        r = await submit_job(s, hub, evil, train, val, token=other_owner_token)
        assert r.status == 201, await r.text()
        other_id = (await r.json())["id"]
        # The untrained job must not take work from alice's: cancel it (it stays listed).
        async with s.post(
            f"{hub.url}/v1/jobs/{other_id}/cancel", headers=hub.auth(other_owner_token)
        ) as cr:
            assert cr.status == 200, await cr.text()

        x = TrainingNode(s, hub.url, attack="sign_flip", samples_per_s=5000.0)
        a = TrainingNode(s, hub.url, samples_per_s=5000.0)
        b = TrainingNode(s, hub.url, samples_per_s=5000.0)
        for n in (x, a, b):
            await n.register()
        # The attacker asks first: it carves shard 0 (replicated for a new node); a replicates
        # it, they disagree, and the referee re-executes both: the attacker's committed training
        # does not give its update. It takes no more work, but hands its states over when asked.
        first = await x.step(wait_s=1.0)
        assert isinstance(first, Assignment) and first.job_id == job_id
        give_up = time.monotonic() + timeout
        while True:
            doc = await job_doc(s, hub, job_id)
            if doc["state"] != "running":
                break
            if time.monotonic() > give_up:
                raise TimeoutError(f"job still {doc['state']} at round {doc['round']}")
            left = await x.work(0.05)
            if isinstance(left, Assignment):
                (await x.abandon(left.assignment_id)).release()
            progressed = False
            for n in (a, b):
                got = await n.step(wait_s=0.3)
                progressed = progressed or got is not None
            if not progressed:
                await asyncio.sleep(0.05)
        assert doc["state"] == "done", doc
        return Scenario(
            job_id=job_id, other_job_id=other_id, attacker=x.node_id, honest=[a.node_id, b.node_id]
        )


async def run_long_job(
    hub: RunningHub, work_dir: Path, *, rounds: int = 15, nodes: int = 5, timeout: float = 180.0
) -> str:
    """alice's digits job of ``rounds`` rounds trained by ``nodes`` honest nodes that claim a
    modest throughput, so that each round is cut into many small shards (some replicated): the
    job page of a long, busy job. Returns its id once done."""
    train, val, _ = write_digits(work_dir)
    spec = digits_spec(rounds=rounds, round_target_s=0.2, chunk_size=64, replication='"adaptive"',
                       replica_wait_s=5.0)
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, hub, spec, train, val)
        assert r.status == 201, await r.text()
        job_id = (await r.json())["id"]
        crew = [MachineNode(s, hub.url, samples_per_s=600.0, machine=i) for i in range(nodes)]
        for n in crew:
            await n.register()
        give_up = time.monotonic() + timeout
        while (doc := await job_doc(s, hub, job_id))["state"] == "running":
            if time.monotonic() > give_up:
                raise TimeoutError(f"job still {doc['state']} at round {doc['round']}")
            done = [await n.step(wait_s=0.2) for n in crew]
            if not any(done):
                await asyncio.sleep(0.05)
        assert doc["state"] == "done", doc
        return job_id


async def first_flag_of(hub: RunningHub, node_id: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{hub.url}/v1/flags", headers=hub.auth(hub.auditor_token)) as r,
    ):
        flags = (await r.json())["flags"]
    # an open one, for the auditor to decide: a flag the hub withdrew (a replica_mismatch whose majority
    # the round's review flagged) is already dismissed, and one made moot by a ban is closed; which
    # of them comes first depends on timing (seen under load)
    mine = [f for f in flags if f["node_id"] == node_id and f["status"] == "open"]
    assert mine, f"no open flag raised against {node_id}: {flags}"
    return mine[0]


__all__ = [
    "ARTIFACTS",
    "CHROMIUM",
    "CHROMIUM_ARGS",
    "EVIL_NAME",
    "Browserish",
    "MachineNode",
    "NoWork",
    "Scenario",
    "TrainingNode",
    "first_flag_of",
    "job_doc",
    "run_job_with_attacker",
    "run_long_job",
]
