"""The web console in a real browser (Debian chromium via playwright) against a
real hub on loopback that ran a small real job with a sign-flipping node.

Screenshots go to tests/artifacts/ (git-ignored). Skipped only when
/usr/bin/chromium is absent (.ci/run installs it; the run then ends with a banner naming
the skip, and fails under CI=true: tests/tooling/skips.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio

from tests.test_console_helpers import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    EVIL_NAME,
    first_flag_of,
    run_job_with_attacker,
    run_long_job,
)

pytestmark = [
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)"
    ),
    pytest.mark.asyncio(loop_scope="module"),
]



@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SimpleNamespace]:
    """Hub + finished job (2 honest nodes, 1 sign-flipper) + one chromium."""
    from playwright.async_api import async_playwright

    from tests.helpers import start_hub

    base = tmp_path_factory.mktemp("console-browser")
    hub = await start_hub(base / "hub")
    pw = browser = None
    try:
        bob = hub.token("owner", "bob")
        scenario = await run_job_with_attacker(hub, base / "digits", other_owner_token=bob)
        flag = await first_flag_of(hub, scenario.attacker)
        long_job = await run_long_job(hub, base / "long")
        pw = await async_playwright().start()
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        ARTIFACTS.mkdir(exist_ok=True)
        yield SimpleNamespace(hub=hub, scenario=scenario, flag=flag, browser=browser, long_job=long_job)
    finally:
        if browser is not None:
            await browser.close()
        if pw is not None:
            await pw.stop()
        await hub.stop()


async def new_page(world: SimpleNamespace, token: str):
    """A fresh browser context (own cookies) logged in through the form reached from the hub's
    root, as from the URL `serve` prints; each role lands on its own first page."""
    ctx = await world.browser.new_context(viewport={"width": 1280, "height": 800})
    page = await ctx.new_page()
    page.set_default_timeout(10_000)
    page.problems = []  # console errors: a CSP violation or a script error shows up here
    page.on(
        "console",
        lambda m: (
            page.problems.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    await page.goto(world.hub.url + "/")
    assert page.url.endswith("/console/login")
    await page.fill("#token", token)
    await page.click("button[type=submit]")
    landing = "flags" if token == world.hub.auditor_token else "jobs"
    await page.wait_for_url(re.compile(rf".*/console/{landing}$"))
    assert "403" not in await page.locator("h1").inner_text()
    return ctx, page


async def test_auditor_confirms_a_flag_and_reputation_changes(world):
    hub, sc, flag = world.hub, world.scenario, world.flag
    ctx, page = await new_page(world, hub.auditor_token)
    try:
        # Before: the attacker is on the Nodes page with no confirmed flag.
        await page.click("nav >> text=Nodes")
        row = page.locator(f'tr[data-node="{sc.attacker}"]')
        rep_before = await row.locator("td.reputation").inner_text()
        assert "0 confirmed" in rep_before

        # The audit queue lists the flag; its page shows the evidence.
        await page.click("nav >> text=Audit queue")
        assert "verified" in await page.locator('[data-live="auditlog"]').inner_text()
        await page.screenshot(path=str(ARTIFACTS / "console_flags.png"), full_page=True)
        await page.click(f'a[href="/console/flags/{flag["id"]}"]')
        await page.wait_for_url(re.compile(rf".*/console/flags/{flag['id']}$"))
        body = await page.locator("main").inner_text()
        assert flag["reason"] in body and sc.attacker in body
        assert "Scores against thresholds" in body and "Node history" in body
        if flag["reason"] == "replica_mismatch":
            assert "Replica comparison" in body
            assert await page.locator("table >> text=no").count() >= 1
        # Per-layer bars against the round's centre (a sign flip points every layer the
        # other way) and the per-tensor replica distances.
        assert "Per-layer L2 norm" in await page.locator("svg.chart").nth(0).inner_html()
        cosines = page.locator(
            'svg.chart:has(title:text-is("Per-layer cosine to the round\'s centre")) rect.bar'
        )
        assert await cosines.count() >= 2
        titles = cosines.locator("title")
        for i in range(await titles.count()):
            title = await titles.nth(i).text_content()
            assert float(title.rsplit(": ", 1)[1]) < 0, title
        await page.screenshot(path=str(ARTIFACTS / "console_flag.png"), full_page=True)

        # Confirm with a note.
        await page.fill(
            "#note", "sign-flipped update: replicas disagree by far more than tolerance"
        )
        await page.click("button[value=confirm]")
        await page.wait_for_url(re.compile(r".*\?done=confirm$"))
        assert "Verdict recorded" in await page.locator(".flash").inner_text()
        assert "confirmed" in await page.locator("h1").inner_text()
        await page.screenshot(path=str(ARTIFACTS / "console_flag_confirmed.png"), full_page=True)

        # After: the Nodes page shows the reputation change.
        await page.click("nav >> text=Nodes")
        rep_after = await page.locator(f'tr[data-node="{sc.attacker}"] td.reputation').inner_text()
        # its flag is the referee's proof (its committed training does not give its update):
        # confirming it bans the node at once (hub/policy/suspension.py)
        assert "1 confirmed" in rep_after and "banned" in rep_after
        for honest in sc.honest:
            txt = await page.locator(f'tr[data-node="{honest}"] td.reputation').inner_text()
            assert "0 confirmed" in txt
        await page.screenshot(path=str(ARTIFACTS / "console_nodes.png"), full_page=True)
        assert page.problems == []
    finally:
        await ctx.close()


async def test_owner_sees_own_job_chart_not_another_owners(world):
    hub, sc = world.hub, world.scenario
    ctx, page = await new_page(world, hub.owner_token)  # alice
    try:
        jobs = await page.locator("main").inner_text()
        assert "digits-mlp" in jobs and "<script>" not in jobs
        assert await page.locator(f'a[href="/console/jobs/{sc.other_job_id}"]').count() == 0
        assert await page.locator("nav >> text=Audit queue").count() == 0
        await page.click(f'a[href="/console/jobs/{sc.job_id}"]')
        await page.wait_for_url(re.compile(rf".*/console/jobs/{sc.job_id}$"))
        # Loss and accuracy charts with one point per round, the shard map, the overhead.
        charts = page.locator("svg.chart")
        assert await charts.count() == 2
        assert await charts.nth(0).locator("circle").count() >= 3
        assert await page.locator("table.shardmap tbody tr").count() >= 1
        # The shard map of round 0: the attacker's assignment and its quarantined update.
        await page.click(f'a[href="/console/jobs/{sc.job_id}?round=0"]')
        shardmap = await page.locator("table.shardmap").inner_text()
        assert sc.attacker in shardmap and "quarantined" in shardmap
        # Each shard's copies are the assignments it gave out that are in flight or returned.
        rows = page.locator("table.shardmap tbody tr")
        for i in range(await rows.count()):
            copies = await rows.nth(i).locator("td").nth(3).inner_text()
            states = await rows.nth(i).locator("td").nth(4).locator(".kv").evaluate_all(
                "els => els.map(e => e.querySelector('.badge').textContent)")
            assert copies.startswith(f"{sum(s in ('live', 'done') for s in states)}\u00d7"), (copies, states)
        await page.goto(f"{hub.url}/console/jobs/{sc.job_id}")
        text = await page.locator("main").inner_text()
        assert "Replication overhead" in text and "Download model" in text
        await page.screenshot(path=str(ARTIFACTS / "console_job.png"), full_page=True)
        async with page.expect_download() as dl_info:
            await page.click("text=Download model (.safetensors)")
        dl = await dl_info.value
        assert dl.suggested_filename.endswith(".safetensors")

        # Another owner's job: not found, and its name never reaches the page.
        resp = await page.goto(f"{hub.url}/console/jobs/{sc.other_job_id}")
        assert resp.status == 404
        assert EVIL_NAME not in await page.content()
        resp = await page.goto(f"{hub.url}/console/nodes")
        assert resp.status == 403
        assert page.problems == []
    finally:
        await ctx.close()


async def test_admin_sees_script_named_job_escaped(world):
    hub, sc = world.hub, world.scenario
    ctx, page = await new_page(world, hub.admin_token)
    try:
        dialogs: list[str] = []
        page.on("dialog", lambda d: dialogs.append(d.message))
        await page.goto(f"{hub.url}/console/jobs/{sc.other_job_id}")
        assert EVIL_NAME in await page.locator("h1").inner_text()  # shown as text
        assert dialogs == []
        # The jobs list, with the vendored polling script swapping in fresh rows.
        await page.goto(f"{hub.url}/console/jobs")
        assert (
            await page.locator(f'a[href="/console/jobs/{sc.other_job_id}"]').inner_text()
            == EVIL_NAME
        )
        from playwright.async_api import expect

        # The script also refreshes when the tab becomes visible: no need to wait 5 s.
        await page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        await expect(page.locator("#live-status")).to_have_text(
            re.compile(r"^updated"), timeout=12_000
        )
        assert dialogs == [] and page.problems == []
        await page.screenshot(path=str(ARTIFACTS / "console_jobs_admin.png"), full_page=True)
    finally:
        await ctx.close()


async def test_every_link_each_role_is_shown_works(world):
    """On a job with closed rounds, shard maps and flags: every console link on every page each
    role reaches answers 200 (an auditor's job links included; no owner link to the nodes)."""
    from tests.test_console_helpers import Browserish

    hub = world.hub
    for token in (hub.auditor_token, hub.owner_token, hub.admin_token):
        b = Browserish(hub.url)
        try:
            await b.login(token)
            seen = await b.crawl()
        finally:
            await b.close()
        assert any(link.startswith(f"/console/jobs/{world.scenario.job_id}?round=") for link in seen), seen
        assert {link: code for link, code in seen.items() if code != 200} == {}, token


async def test_form_post_without_csrf_token_is_refused(world):
    hub, flag = world.hub, world.flag
    ctx, page = await new_page(world, hub.auditor_token)
    try:
        # Strip the hidden CSRF field from the real Log out form, then submit it.
        await page.evaluate("document.querySelector('header form input[name=csrf_token]').remove()")
        async with page.expect_response(lambda r: r.request.method == "POST") as info:
            await page.click("header button[type=submit]")
        assert (await info.value).status == 403
        # A scripted verdict post with the session cookie but no token.
        resp = await page.request.post(
            f"{hub.url}/console/flags/{flag['id']}/verdict",
            form={"verdict": "dismiss", "note": "forged"},
        )
        assert resp.status == 403
        # Still logged in, nothing changed.
        resp = await page.goto(f"{hub.url}/console/flags/{flag['id']}")
        assert resp.status == 200
        assert "dismissed" not in await page.locator("h1").inner_text()
    finally:
        await ctx.close()


async def test_console_works_without_javascript(world):
    hub, sc = world.hub, world.scenario
    ctx = await world.browser.new_context(java_script_enabled=False)
    try:
        page = await ctx.new_page()
        page.set_default_timeout(10_000)
        await page.goto(f"{hub.url}/console/jobs/{sc.job_id}")  # -> login, then back here
        await page.fill("#token", hub.owner_token)
        await page.click("button[type=submit]")
        await page.wait_for_url(re.compile(rf".*/console/jobs/{sc.job_id}$"))
        assert await page.locator("svg.chart polyline").count() >= 2
        assert "3 of 3 closed" in await page.locator("main").inner_text()
    finally:
        await ctx.close()


WIDTH, HEIGHT = 1280, 800
# Every node id drawn on the page (whole, or cut short with "…"), and those whose characters
# sit on more than one line.
NODE_IDS_JS = """() => {
    const re = /gf1-[a-z2-7]{4}(?:-[a-z2-7]{4}){0,4}…?/g;
    const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    const wrapped = [];
    let nodeids = 0;
    while (walk.nextNode()) {
        const text = walk.currentNode;
        for (const m of text.textContent.matchAll(re)) {
            const range = document.createRange();
            range.setStart(text, m.index);
            range.setEnd(text, m.index + m[0].length);
            const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
            if (lines.size > 0) { nodeids += 1; }
            if (lines.size > 1) { wrapped.push(m[0]); }
        }
    }
    return {width: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight,
            nodeids: nodeids, wrapped: wrapped.length};
}"""


async def _layout(page, name: str) -> dict[str, int]:
    """The page's size at the window's width, and the node ids drawn on more than one line."""
    await page.screenshot(path=str(ARTIFACTS / f"layout_{name}.png"), full_page=True)
    return await page.evaluate(NODE_IDS_JS)


async def test_pages_fit_a_1280_window(world):
    """At 1280x800 no console page is wider than the window, node ids are never broken across
    lines, and the page of a 15-round job stays within three screens."""
    hub, sc = world.hub, world.scenario
    pages = {
        "owner": [("job", f"/console/jobs/{sc.job_id}"), ("job_long", f"/console/jobs/{world.long_job}")],
        "auditor": [("nodes", "/console/nodes"), ("flags", "/console/flags?status=all"),
                    ("flag", f"/console/flags/{world.flag['id']}"),
                    ("review_long", f"/console/jobs/{world.long_job}")],
    }
    sizes = {}
    for role, paths in pages.items():
        ctx, page = await new_page(world, hub.auditor_token if role == "auditor" else hub.owner_token)
        try:
            for name, path in paths:
                resp = await page.goto(hub.url + path)
                assert resp.status == 200, path
                sizes[name] = await _layout(page, name)
        finally:
            await ctx.close()
    for name, size in sizes.items():
        assert size["width"] <= WIDTH, (name, size)
        assert size["wrapped"] == 0, (name, size)
    assert sizes["nodes"]["nodeids"] >= 3 and sizes["job_long"]["nodeids"] >= 5, sizes
    assert sizes["job_long"]["height"] <= 3 * HEIGHT, sizes
    assert sizes["review_long"]["height"] <= 3 * HEIGHT, sizes


async def test_a_folded_section_the_reader_opened_stays_open_across_a_refresh(world):
    from playwright.async_api import expect

    hub, node = world.hub, world.scenario.honest[0]
    ctx, page = await new_page(world, hub.auditor_token)
    try:
        await page.goto(f"{hub.url}/console/nodes")
        keys = page.locator(f'tr[data-node="{node}"] details.classkeys')
        await keys.locator("summary").click()
        assert await keys.evaluate("d => d.open")
        # A stale copy on the page, so that the refresh replaces the table for sure.
        await page.evaluate("document.querySelector('[data-live=nodes]').append('stale copy')")
        await page.evaluate("document.dispatchEvent(new Event('visibilitychange'))")
        await expect(page.locator("#live-status")).to_have_text(re.compile(r"^updated"), timeout=12_000)
        assert "stale copy" not in await page.locator("[data-live=nodes]").inner_text()
        assert await page.locator(f'tr[data-node="{node}"] details.classkeys').evaluate("d => d.open")
        assert page.problems == []
    finally:
        await ctx.close()
