"""Web console without a browser: auth, roles, CSRF, escaping, headers, charts.

One real hub (create_app + the console) on loopback for the module; each test
logs in through the login form with its own cookie jar.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp
import pytest
import pytest_asyncio
from gpuflex.hub.server.appkeys import DB

from tests.helpers import RunningHub, digits_spec, store_for, submit_job, write_digits
from tests.test_console_helpers import EVIL_NAME, Browserish, TrainingNode

pytestmark = pytest.mark.asyncio(loop_scope="module")

# The referee's evidence when an update is not its committed last state minus the round's model
# (hub/policy/referee.py): the check fails before any replay, so this update has no segment distance,
# while its replica's re-executed segment reproduced (distance 0, within its threshold).
BINDING_MISMATCH = {
    "referee": {"check": "segment_replay", "round": 0, "node": "gf1-x", "update": "u-test-6", "steps": [0, 8],
                "last_step": 16, "precision": "fp32", "threshold": 0.001, "reason": "spot_check",
                "outcome": "mismatch", "binding_distance": 0.8125,
                "why": "the update is not the committed last state minus the round's model"},
    "group": [{"update": "u-test-7", "node": "gf1-y", "round": 0, "steps": [0, 8], "precision": "fp32",
               "threshold": 0.001, "reason": "spot_check", "outcome": "reproduced", "distance": 0.0}],
    "pairs": [], "tolerance": 1e-4}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hub(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[SimpleNamespace]:
    """alice's job, bob's job named like a script tag, a registered node with one open flag."""
    from gpuflex.hub.policy.update_record import Flag
    from gpuflex.hub.storage.store_sqlite import insert_flags

    from tests.helpers import start_hub

    base = tmp_path_factory.mktemp("console")
    h: RunningHub = await start_hub(base / "hub")
    bob = h.token("owner", "bob")
    train, val, _ = write_digits(base / "digits")
    async with aiohttp.ClientSession() as s:
        r = await submit_job(s, h, digits_spec(rounds=2), train, val)
        assert r.status == 201, await r.text()
        alice_job = (await r.json())["id"]
        evil = digits_spec(rounds=1).replace('name = "digits-mlp"', f'name = "{EVIL_NAME}"')
        r = await submit_job(s, h, evil, train, val, token=bob)
        assert r.status == 201, await r.text()
        bob_job = (await r.json())["id"]
        node = TrainingNode(s, h.url)
        await node.register()

    # Flags as verification raises them: through the store's own insert.
    def insert(conn: sqlite3.Connection) -> list[str]:
        ev = {
            "problems": ["cosine -0.99 to the round's median < 0"],
            "cosine": -0.99,
            "norm_ratio": 1.1,
            "update_norm": 2.0,
            "median_norm_per_sample": 0.01,
            "shard_samples": 200,
            "scored_updates": 3,
            "layers": [
                {"name": "0.weight", "norm": 1.9, "centre_norm": 1.7, "cosine": -0.99},
                {"name": "<b>0.bias</b>", "norm": 0.2, "centre_norm": 0.3, "cosine": -0.9},
            ],
        }
        insert_flags(
            conn,
            alice_job,
            0,
            [
                Flag("u-test-1", node.node_id, "outlier", ev),
                Flag("u-test-2", node.node_id, "outlier", ev),
                Flag(
                    "u-test-3", node.node_id, "free_rider", {"update_norm": 0.0, "threshold": 1e-7}
                ),
                # the referee's verdict as hub/policy/round_policy.py records it (hub/policy/referee.py evidence)
                Flag("u-test-4", node.node_id, "referee_mismatch", {
                    "referee": {"check": "segment_replay", "round": 0, "node": node.node_id, "update": "u-test-4",
                                "steps": [12, 24], "last_step": 96, "precision": "bf16", "threshold": 0.15,
                                "reason": "disagreement", "outcome": "mismatch", "distance": 2.47},
                    "group": [{"update": "u-test-5", "node": "gf1-other", "round": 0, "steps": [12, 24],
                               "precision": "fp32", "threshold": 0.001, "reason": "disagreement",
                               "outcome": "reproduced", "distance": 3.1e-7}],
                    "pairs": [{"a": "u-test-4", "b": "u-test-5", "relative_distance": 0.9, "agree": False,
                               "tensors": {}}], "tolerance": 1e-4}),
                Flag("u-test-6", node.node_id, "referee_mismatch", BINDING_MISMATCH),
            ],
            time.time(),
        )
        return [r[0] for r in conn.execute("SELECT id FROM flags ORDER BY update_id")]

    flag_ids = await h.app[DB].write(insert)
    try:
        yield SimpleNamespace(
            hub=h,
            url=h.url,
            bob=bob,
            alice_job=alice_job,
            bob_job=bob_job,
            node_id=node.node_id,
            flags=flag_ids,
            data_dir=h.data_dir,
        )
    finally:
        await h.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def browser(hub: SimpleNamespace) -> AsyncIterator[Browserish]:
    b = Browserish(hub.url)
    try:
        yield b
    finally:
        await b.close()


# --------------------------------------------------------------------------- pages and auth


async def test_an_auditor_logging_in_at_the_served_url_lands_on_the_audit_queue(hub, browser):
    """`serve` prints URL/console/: the login form it leads to brings each role to its own page."""
    for token, landing in ((hub.hub.auditor_token, "/console/flags"), (hub.hub.owner_token, "/console/jobs")):
        b = Browserish(hub.url)
        try:
            status, _, r = await b.get("/console/")
            assert status == 302 and r.headers["Location"] == "/console/login"
            status, html, _ = await b.get("/console/login")
            nxt = re.search(r'name="next" value="([^"]*)"', html)
            assert nxt
            status, _, r = await b.post("/console/login", {"csrf_token": b.csrf_in(html), "token": token,
                                                           "next": nxt.group(1)})
            assert status == 303
            async with b.session.get(hub.url + r.headers["Location"]) as page:
                assert page.status == 200 and page.url.path == landing, (token, page.url)
            status, _, r = await b.get("/console/login")  # already logged in
            assert status == 302 and r.headers["Location"] == landing
        finally:
            await b.close()


async def test_an_auditor_reviews_a_job_without_its_metrics_or_models(hub, browser):
    await browser.login(hub.hub.auditor_token)
    status, _, r = await browser.get("/console/jobs")  # no jobs list for an auditor
    assert status == 302 and r.headers["Location"] == "/console/flags"
    status, html, _ = await browser.get(f"/console/jobs/{hub.alice_job}")
    assert status == 200, html[:500]
    assert "digits-mlp" in html and "Shard map" in html and "Flags on this job" in html
    for owner_only in ("/model", "Download model", "alice", "Val. loss", "validation samples", "<svg"):
        assert owner_only not in html, owner_only
    status, html, _ = await browser.get("/console/jobs/j-none")
    assert status == 404
    status, html, _ = await browser.get(f"/console/jobs/{hub.alice_job}/model")  # models stay the owner's
    assert status == 403 and "wrong_role" in html


async def test_every_link_the_console_shows_works(hub):
    """Each role's pages link only to pages that role may read."""
    for token in (hub.hub.auditor_token, hub.hub.owner_token, hub.hub.admin_token):
        b = Browserish(hub.url)
        try:
            await b.login(token)
            seen = await b.crawl()
        finally:
            await b.close()
        assert len(seen) > 3, seen
        assert {link: code for link, code in seen.items() if code != 200} == {}, token


async def test_root_redirects_and_pages_need_login(hub, browser):
    status, _, r = await browser.get("/")
    assert status == 302 and r.headers["Location"] == "/console/"
    status, _, r = await browser.get("/console/jobs")
    assert status == 302 and r.headers["Location"].startswith("/console/login")
    status, html, _ = await browser.get("/console/login")
    assert status == 200 and 'name="token"' in html


async def test_security_headers_and_no_inline_code(hub, browser):
    status, _, r = await browser.get("/console/login")
    assert status == 200 and r.headers["X-Frame-Options"] == "DENY"
    await browser.login(hub.hub.admin_token)
    for path in (
        "/console/jobs",
        f"/console/jobs/{hub.alice_job}",
        "/console/nodes",
        "/console/flags",
        f"/console/flags/{hub.flags[0]}",
    ):
        status, html, r = await browser.get(path)
        assert status == 200, (path, html[:300])
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert r.headers["X-Frame-Options"] == "DENY"
        assert r.headers["Referrer-Policy"] in ("same-origin", "no-referrer", "strict-origin")
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Cache-Control"] == "no-store"
        # No inline script, no inline event handler, no inline style, nothing external.
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), path
        assert not re.search(r"\son[a-z]+\s*=", html), path
        assert not re.search(r"\sstyle\s*=", html), path
        assert not re.search(r"(src|href)=\"(https?:)?//", html), path
    status, js, r = await browser.get("/console/static/console.js")
    assert status == 200 and "fetch(" in js
    # The hub's own API keeps its headers untouched by the console.
    status, _, r = await browser.get("/healthz")
    assert "Content-Security-Policy" not in r.headers


async def test_login_cookie_is_opaque_httponly_strict(hub, browser):
    r = await browser.login(hub.hub.owner_token)
    morsel = r.cookies["gpuflex_console"]
    assert morsel["httponly"] and morsel["samesite"] == "Strict" and morsel["path"] == "/console"
    sid = morsel.value
    assert hub.hub.owner_token not in sid and len(sid) >= 40
    # Stored server-side only as a hash.
    db = sqlite3.connect(hub.data_dir / "console.sqlite3")
    try:
        hashes = {row[0] for row in db.execute("SELECT sid_hash FROM console_sessions")}
        dump = "\n".join(db.iterdump())
    finally:
        db.close()
    assert hashlib.sha256(sid.encode()).hexdigest() in hashes
    assert sid not in dump and hub.hub.owner_token not in dump


async def test_bad_token_and_forged_login_are_refused(hub, browser):
    status, html, _ = await browser.get("/console/login")
    csrf = browser.csrf_in(html)
    status, html, r = await browser.post(
        "/console/login", {"csrf_token": csrf, "token": "gft_nope"}
    )
    assert status == 401 and "unknown or revoked" in html
    assert "gpuflex_console" not in r.cookies
    # A login post without the double-submit token, or from another origin, is refused.
    status, _, _ = await browser.post("/console/login", {"token": hub.hub.owner_token})
    assert status == 403
    status, html, _ = await browser.get("/console/login")
    status, _, _ = await browser.post(
        "/console/login",
        {"csrf_token": browser.csrf_in(html), "token": hub.hub.owner_token},
        headers={"Origin": "http://evil.example"},
    )
    assert status == 403


async def test_owner_sees_only_own_jobs(hub, browser):
    await browser.login(hub.hub.owner_token)  # alice
    status, html, _ = await browser.get("/console/jobs")
    assert status == 200
    assert hub.alice_job in html and hub.bob_job not in html
    status, _, _ = await browser.get(f"/console/jobs/{hub.alice_job}")
    assert status == 200
    for path in (f"/console/jobs/{hub.bob_job}", f"/console/jobs/{hub.bob_job}/model"):
        status, html, _ = await browser.get(path)
        assert status == 404 and EVIL_NAME not in html
    status, _, _ = await browser.get("/console/nodes")
    assert status == 403
    status, _, _ = await browser.get("/console/flags")
    assert status == 403
    # An owner may read a flag on their own job (as GET /v1/flags/{id}) but not decide it.
    status, html, _ = await browser.get(f"/console/flags/{hub.flags[0]}")
    assert status == 200 and "Only auditors and admins give verdicts" in html
    assert 'action="/console/flags/' not in html
    csrf = await browser.page_csrf()
    status, _, _ = await browser.post(
        f"/console/flags/{hub.flags[0]}/verdict",
        {"csrf_token": csrf, "verdict": "confirm", "note": "x"},
    )
    assert status == 403


async def test_owner_downloads_model(hub, browser):
    await browser.login(hub.hub.owner_token)
    async with browser.session.get(f"{hub.url}/console/jobs/{hub.alice_job}/model") as r:
        assert r.status == 200
        assert "attachment" in r.headers["Content-Disposition"]
        data = await r.read()
    from gpuflex.protocol.tensors import state_from_safetensors

    assert "0.weight" in state_from_safetensors(data)
    async with browser.session.get(f"{hub.url}/console/jobs/{hub.alice_job}/model?round=0") as r:
        assert r.status == 200 and "-v0.safetensors" in r.headers["Content-Disposition"]
    for bad in ("x", "-1", "9999999999"):
        status, _, _ = await browser.get(f"/console/jobs/{hub.alice_job}/model?round={bad}")
        assert status == 400
    status, _, _ = await browser.get(f"/console/jobs/{hub.alice_job}/model?round=7")
    assert status == 404


async def test_script_job_name_is_escaped(hub, browser):
    await browser.login(hub.hub.admin_token)
    for path in ("/console/jobs", f"/console/jobs/{hub.bob_job}"):
        status, html, _ = await browser.get(path)
        assert status == 200
        assert EVIL_NAME not in html
        assert "&lt;script&gt;alert(" in html


async def test_form_posts_need_the_session_csrf_token(hub, browser):
    await browser.login(hub.hub.auditor_token)
    flag = hub.flags[1]
    for data in (
        {"verdict": "dismiss", "note": "n"},
        {"verdict": "dismiss", "note": "n", "csrf_token": "wrong"},
    ):
        status, html, _ = await browser.post(f"/console/flags/{flag}/verdict", data)
        assert status == 403, html[:300]
    status, _, _ = await browser.post("/console/logout", {})
    assert status == 403
    # Right token, wrong origin: refused too.
    csrf = await browser.page_csrf("/console/flags")
    status, _, _ = await browser.post(
        f"/console/flags/{flag}/verdict",
        {"csrf_token": csrf, "verdict": "dismiss", "note": "n"},
        headers={"Origin": "http://evil.example"},
    )
    assert status == 403
    status, html, _ = await browser.get(f"/console/flags/{flag}")
    assert ">open<" in html  # nothing changed
    # No session at all: a post is refused, not redirected.
    anon = Browserish(hub.url)
    try:
        status, _, _ = await anon.post(f"/console/flags/{flag}/verdict", {"verdict": "dismiss"})
        assert status == 403
    finally:
        await anon.close()


async def test_auditor_verdict_moves_reputation_and_audit_log(hub, browser):
    await browser.login(hub.hub.auditor_token)
    flag = hub.flags[0]
    status, html, _ = await browser.get("/console/nodes")
    assert status == 200 and hub.node_id in html
    assert "0 confirmed" in html
    csrf = await browser.page_csrf(f"/console/flags/{flag}")
    status, body, r = await browser.post(
        f"/console/flags/{flag}/verdict",
        {"csrf_token": csrf, "verdict": "confirm", "note": "sign flipped <b>clearly</b>"},
    )
    assert status == 303, body[:500]
    status, html, _ = await browser.get(r.headers["Location"])
    assert "Verdict recorded" in html and "confirmed" in html
    assert "sign flipped &lt;b&gt;clearly&lt;/b&gt;" in html
    status, html, _ = await browser.get("/console/nodes")
    assert "suspect (1 confirmed)" in html
    # The same path as the API: the verdict is in the hub's flag row and audit log.
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{hub.url}/v1/flags/{flag}", headers=hub.hub.auth(hub.hub.auditor_token)) as resp,
    ):
        doc = await resp.json()
    assert doc["status"] == "confirmed" and doc["auditor"] == "audrey"
    status, html, _ = await browser.get("/console/flags?status=confirmed")
    assert flag in html and "verified" in html
    # A second verdict on the same flag is refused by the hub's function.
    csrf = await browser.page_csrf("/console/flags")
    status, html, _ = await browser.post(
        f"/console/flags/{flag}/verdict",
        {"csrf_token": csrf, "verdict": "dismiss", "note": "again"},
    )
    assert status == 409


async def test_flag_page_shows_scores_and_layers(hub, browser):
    await browser.login(hub.hub.auditor_token)
    status, html, _ = await browser.get(f"/console/flags/{hub.flags[1]}")  # an open outlier
    assert status == 200
    assert "cosine to round centre" in html and "beyond" in html and "within" in html
    assert "Per-layer L2 norm: this update vs. the round" in html
    assert "Per-layer cosine to the round" in html
    assert "&lt;b&gt;0.bias&lt;/b&gt;" in html and "<b>0.bias" not in html
    assert "Node history" in html and hub.node_id in html
    assert 'name="verdict" value="confirm"' in html


async def test_flag_page_shows_the_referees_re_executed_segments(hub, browser):
    await browser.login(hub.hub.auditor_token)
    status, html, _ = await browser.get(f"/console/flags/{hub.flags[3]}")
    assert status == 200
    assert "Referee re-execution" in html and "12\u201324" in html
    assert "2.47" in html and "0.15" in html and "reproduced" in html and "mismatch" in html
    assert "re-executed segment (steps 12-24)" in html  # both distances against their thresholds
    # the UPDATE column names each re-executed update (not a dict method's repr)
    assert "u-test-4 (this)" in html and "u-test-5<" in html and "built-in method" not in html
    async with aiohttp.ClientSession() as s, s.get(
            f"{hub.url}/v1/flags/{hub.flags[3]}", headers=hub.hub.auth(hub.hub.auditor_token)) as r:
        doc = await r.json()
    assert [(x["update"], x["outcome"], x["distance"]) for x in doc["referee"]] == [
        ("u-test-4", "mismatch", 2.47), ("u-test-5", "reproduced", 3.1e-7)]
    assert sum(1 for x in doc["scores"] if "re-executed segment" in x["name"]) == 2


async def test_a_referee_flag_leads_with_the_check_it_failed(hub, browser):
    """The headline names the failed binding check and its distance, in the console and the API
    alike, and never the replica's passing segment (0, within 0.001)."""
    await browser.login(hub.hub.auditor_token)
    status, html, _ = await browser.get(f"/console/flags/{hub.flags[4]}")
    assert status == 200
    head = re.search(r'<dd class="headline fail">([^<]*)</dd>', html)
    assert head, html[:2000]
    expected = ("referee: the update is not the committed last state minus the round&#39;s model:"
                " relative distance 0.8125 (must be 0)")
    assert head.group(1) == expected
    async with aiohttp.ClientSession() as s, s.get(
            f"{hub.url}/v1/flags/{hub.flags[4]}", headers=hub.hub.auth(hub.hub.auditor_token)) as r:
        doc = await r.json()
    assert doc["headline"] == expected.replace("&#39;", "'")
    beyond = [x for x in doc["scores"] if x["ok"] is False]
    assert [(x["name"], x["value"]) for x in beyond] == [
        ("this update vs. its committed last state minus the round's model", 0.8125)]


async def test_revoked_token_ends_the_session(hub, browser):
    from gpuflex.hub.storage.token_admin import create_token, list_tokens, revoke_token

    store = store_for(hub.data_dir)  # the fixture's hub is a namespace over the running one
    token = create_token(hub.data_dir, "auditor", "temp-auditor", store=store)
    await browser.login(token)
    status, _, _ = await browser.get("/console/nodes")
    assert status == 200
    tid = next(t["id"] for t in list_tokens(hub.data_dir, store=store) if t["name"] == "temp-auditor")
    revoke_token(hub.data_dir, int(tid), store=store)
    status, _, r = await browser.get("/console/nodes")
    assert status == 302 and r.headers["Location"].startswith("/console/login")


async def test_logout_ends_the_session(hub, browser):
    await browser.login(hub.hub.owner_token)
    csrf = await browser.page_csrf()
    status, _, _ = await browser.post("/console/logout", {"csrf_token": csrf})
    assert status == 303
    status, _, _ = await browser.get("/console/jobs")
    assert status == 302


async def test_audit_queue_reports_a_tampered_log(hub, browser):
    """Last in the module: it edits the hub's audit log behind its back."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{hub.url}/v1/flags/{hub.flags[2]}/verdict",
            json={"verdict": "dismiss", "note": "honest zero update"},
            headers=hub.hub.auth(hub.hub.auditor_token),
        ) as r,
    ):
        assert r.status == 200, await r.text()
    await browser.login(hub.hub.auditor_token)
    status, html, _ = await browser.get("/console/flags?status=all")
    assert status == 200 and "verified" in html and "head <code" in html
    log = hub.data_dir / "audit.jsonl"
    data = log.read_bytes()
    at = data.rindex(b"honest zero update")
    with open(log, "r+b") as f:  # same length, one word changed: the chain must break
        f.seek(at)
        f.write(b"HONEST")
    edited = data[:at].count(b"\n") + 1  # the 1-based line an editor shows
    status, html, _ = await browser.get("/console/flags?status=all")
    assert "VERIFICATION FAILED" in html
    assert f"at line {edited}:" in html and f"line {edited}: hash does not match" in html, html
