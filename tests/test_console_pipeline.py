"""The console shows a pipelined job's pipeline: a real hub on 127.0.0.1 and SQLite, nodes
registered and polling with signed requests, stages reporting over the real wire, and each role's
pages fetched through the login form like a browser.

The page shows the document GET /v1/jobs/{id} answers (and `job status` prints): while the job
waits, the planner's line; once planned, the live generation's stages (units, node, memory used
and offered, predicted and measured time, steps done), its bubble, the committed step and the
last stage's loss; every generation with why it was planned. Admins see it as the owner does, an
auditor without the loss, another owner not at all. Below it, while the job is queued or running,
the plan it would get now: the document GET /v1/jobs/{id}/plan answers (and `job plan` prints),
or its one-line refusal; an auditor's without the model's size and the batch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpuflex.hub.ops.cli_pipeline import pipeline_lines
from gpuflex.hub.ops.cli_plan import seconds, size
from gpuflex.hub.server.console import f_flops
from markupsafe import escape

from tests.pipeline_hub import (
    DIGITS_SPEC,
    HubThread,
    ack_of,
    poll_until,
    register,
    request,
    send_report,
    submit,
)
from tests.test_console_browser import HEIGHT, NODE_IDS_JS, WIDTH
from tests.test_console_helpers import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, Browserish

SPEC = DIGITS_SPEC.format(stages=2, steps=4, every=2)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubThread]:
    h = HubThread(tmp_path / "hub", stage_timeout_s=30.0)
    yield h
    h.stop()


def page(hub: HubThread, token: str, path: str) -> tuple[int, str]:
    """One console page as a browser logged in with ``token`` gets it."""

    async def fetch() -> tuple[int, str]:
        b = Browserish(hub.url)
        try:
            await b.login(token)
            status, text, _ = await b.get(path)
            return status, text
        finally:
            await b.close()

    return asyncio.run(fetch())


def job_doc(hub: HubThread, job_id: str) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {hub.tokens['owner']}"}
    code, _, body = request(hub.url, "GET", f"/v1/jobs/{job_id}", None, auth)
    assert code == 200, body
    return dict(json.loads(body))


def pipeline_of(hub: HubThread, job_id: str) -> dict[str, Any]:
    return dict(job_doc(hub, job_id)["pipeline"])


def wait_for(hub: HubThread, job_id: str, test: Any, what: str) -> dict[str, Any]:
    give_up = time.monotonic() + 20
    while not test(p := pipeline_of(hub, job_id)):
        assert time.monotonic() < give_up, f"waited for {what}: {p}"
        time.sleep(0.1)
    return p


def test_the_job_page_shows_the_pipeline_each_role_may_see(hub: HubThread, tmp_path: Path) -> None:
    first = register(hub.url)
    code, job = submit(hub, tmp_path, SPEC)
    assert code == 201, job
    job_id, path = job["id"], f"/console/jobs/{job['id']}"
    p = wait_for(hub, job_id, lambda p: "needs" in (p["waiting"] or ""), "the planner's refusal")
    status, shown = page(hub, hub.tokens["owner"], path)
    assert status == 200, shown[:500]
    assert escape(p["waiting"]) in shown and "step 0 of 4 committed" in shown
    assert "Shard map" not in shown and "No generation planned yet." in shown
    status, listed = page(hub, hub.tokens["owner"], "/console/jobs")
    assert status == 200 and "step 0 / 4" in listed

    keys = [first, register(hub.url)]
    got = poll_until(hub, keys)
    for sa, key in zip(got, keys, strict=True):
        last = sa.stage == len(got) - 1
        code, answer = send_report(hub.url, key, sa, 1, loss=2.3125 if last else None)
        assert code == 200 and ack_of(hub, answer).ok
    p = wait_for(
        hub, job_id, lambda p: p["generation"] and p["generation"]["loss"], "a reported loss"
    )
    g = p["generation"]
    for role in ("owner", "admin"):
        status, shown = page(hub, hub.tokens[role], path)
        assert status == 200, shown[:500]
        assert f"Generation {g['number']}" in shown and escape(g["reason"]) in shown
        for st in g["stages"]:
            row = shown.split(f'<tr data-stage="{st["stage"]}">')[1].split("</tr>")[0]
            assert st["node_id"] in row and ", ".join(st["unit_names"]) in row, row
            assert f"{size(st['memory_bytes'])} / {size(st['offered_bytes'])}" in row, row
            assert seconds(st["predicted_micro_batch_s"]) in row and seconds(st["step_s"]) in row
        assert f"{100 * g['bubble_fraction']:.1f}%" in shown
        assert "2.312" in shown and "Loss" in shown  # the last stage's loss
        assert f"predicted {seconds(g['predicted_step_s'])}" in shown
        assert f"measured {seconds(g['measured_step_s'])}" in shown
    printed = "\n".join(pipeline_lines(job_doc(hub, job_id)))  # `job status`: the same numbers
    for st in g["stages"]:
        assert f"{size(st['memory_bytes'])} / {size(st['offered_bytes'])}" in printed, printed
    status, review = page(hub, hub.tokens["auditor"], path)
    assert status == 200, review[:500]
    assert all(st["node_id"] in review for st in g["stages"]) and escape(g["reason"]) in review
    assert "2.312" not in review and "Loss" not in review and "/model" not in review
    stranger = hub.hub.token("owner", "bob")
    status, _ = page(hub, stranger, path)
    assert status == 404

    code, answer = send_report(
        hub.url, keys[0], got[0], 1, failed="a peer's tensor did not come within 60 s"
    )
    assert code == 200 and not ack_of(hub, answer).ok
    poll_until(hub, keys)
    p = wait_for(
        hub, job_id, lambda p: len(p["generations"]) == 2 and p["generation"], "a second generation"
    )
    status, shown = page(hub, hub.tokens["owner"], path)
    assert status == 200
    assert 'data-generation="2"' in shown and 'data-generation="1"' in shown
    assert escape(p["generations"][1]["reason"]) in shown and "stopped: a peer" in shown


def plan_doc(hub: HubThread, job_id: str) -> dict[str, Any]:
    """GET /v1/jobs/{id}/plan as the job's owner (`gpuflex-hub job plan`)."""
    auth = {"Authorization": f"Bearer {hub.tokens['owner']}"}
    code, _, body = request(hub.url, "GET", f"/v1/jobs/{job_id}/plan", None, auth)
    assert code == 200, body
    return dict(json.loads(body))


PLAN_HEADING = "<h2>Plan it would get now</h2>"


def plan_part(shown: str) -> str:
    """The job page's plan section (it comes last in the pipeline's part of the page)."""
    assert PLAN_HEADING in shown, shown[-2000:]
    return shown.split(PLAN_HEADING)[1]


def test_the_job_page_shows_the_plan_the_api_gives(hub: HubThread, tmp_path: Path) -> None:
    """Two nodes of different speeds: the page's stages, step time, bubble, micro-batches and
    offers are the figures GET /v1/jobs/{id}/plan gives; an auditor's review shows the stages
    without the model's size or the batch."""
    for sps in (1000.0, 4000.0):
        register(hub.url, samples_per_s=sps)
    code, job = submit(hub, tmp_path, SPEC)
    assert code == 201, job
    doc = plan_doc(hub, job["id"])
    p = doc["plan"]
    (q,) = p["pipelines"]
    assert len(q["stages"]) == 2
    path = f"/console/jobs/{job['id']}"
    for role in ("owner", "admin"):
        status, shown = page(hub, hub.tokens[role], path)
        assert status == 200, shown[:500]
        part = plan_part(shown)
        for st in q["stages"]:
            assert st["micro_batch_s"] == pytest.approx(st["compute_s"] + st["transfer_s"])
            row = part.split(f'<tr data-plan-stage="0.{st["stage"]}">')[1].split("</tr>")[0]
            assert st["node_id"] in row and ", ".join(st["unit_names"]) in row, row
            assert f"{size(st['memory_bytes'])} / {size(st['offered_bytes'])}" in row, row
            for key in ("micro_batch_s", "compute_s", "transfer_s", "update_s"):
                assert seconds(st[key]) in row, (key, row)
        step = part.split('data-plan="step">')[1].split("</dd>")[0]
        assert f"predicted {seconds(p['step_s'])}" in step, step
        line = part.split('data-plan="pipeline-0">')[1].split("</dd>")[0]
        assert f"{q['micro_batches']} micro-batches of {q['micro_batch_size']}" in line, line
        assert f"schedule {q['schedule']}" in line and f"{100 * q['bubble_fraction']:.1f}%" in line
        assert 'data-plan="pipelines">1</dd>' in part
        for n in doc["offers"]["nodes"]:
            offer = part.split(f'<tr data-offer="{n["node_id"]}">')[1].split("</tr>")[0]
            assert size(n["memory_bytes"]) in offer and "benchmark" in offer, offer
            assert f_flops(n["flops_per_s"]) in offer, offer
        assert f"batch {doc['batch_size']}" in part and 'data-plan="model"' in part
        assert 'data-plan="refused"' not in part
    status, review = page(hub, hub.tokens["auditor"], path)
    assert status == 200, review[:500]
    part = plan_part(review)
    assert all(f'<tr data-plan-stage="0.{st["stage"]}">' in part for st in q["stages"])
    assert f"predicted {seconds(p['step_s'])}" in part
    assert 'data-plan="model"' not in part and "of state (parameters" not in part


def test_when_no_plan_fits_the_job_page_gives_the_planners_line(
    hub: HubThread, tmp_path: Path
) -> None:
    """One node for a job of two stages: the page gives the API's one-line refusal, to the owner
    and to an auditor; once the job is over, the page plans nothing."""
    register(hub.url)
    code, job = submit(hub, tmp_path, SPEC)
    assert code == 201, job
    doc = plan_doc(hub, job["id"])
    assert "plan" not in doc and doc["refused"], doc
    path = f"/console/jobs/{job['id']}"
    for role in ("owner", "auditor"):
        status, shown = page(hub, hub.tokens[role], path)
        assert status == 200, shown[:500]
        part = plan_part(shown)
        refused = part.split('data-plan="refused">')[1].split("</dd>")[0]
        assert refused == f"<p>{escape(doc['refused'])}</p>", refused
        assert "data-plan-stage" not in part and 'data-plan="step"' not in part
    auth = {"Authorization": f"Bearer {hub.tokens['owner']}"}
    code, _, body = request(hub.url, "POST", f"/v1/jobs/{job['id']}/cancel", b"", auth)
    assert code == 200, body
    status, shown = page(hub, hub.tokens["owner"], path)
    assert status == 200 and PLAN_HEADING not in shown


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (apt-get install -y chromium)"
)
def test_the_pipeline_fits_a_1280_window_in_chromium(hub: HubThread, tmp_path: Path) -> None:
    """Three stages and a re-plan whose reason names a node, and the plan it would get now with
    its offers open: no wider than the window, no node id broken across lines, no script or CSP
    error."""
    keys = [register(hub.url) for _ in range(3)]
    code, job = submit(hub, tmp_path, SPEC.replace("stages = 2", "stages = 3"))
    assert code == 201, job
    got = poll_until(hub, keys)
    send_report(hub.url, keys[0], got[0], 0, failed="a peer's tensor did not come within 60 s")
    got = poll_until(hub, keys)
    for sa, key in zip(got, keys, strict=True):
        send_report(hub.url, key, sa, 1, loss=2.5 if sa.stage == 2 else None)
    wait_for(
        hub, job["id"], lambda p: p["generation"] and p["generation"]["loss"], "a reported loss"
    )

    async def look() -> tuple[dict[str, int], list[str]]:
        from playwright.async_api import async_playwright

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
                problems: list[str] = []
                page.on("pageerror", lambda e: problems.append(str(e)))
                page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
                await page.goto(f"{hub.url}/console/login")
                await page.fill("#token", hub.tokens["owner"])
                await page.click("button[type=submit]")
                await page.wait_for_url(f"{hub.url}/console/jobs")
                await page.goto(f"{hub.url}/console/jobs/{job['id']}")
                await page.click("details[data-key=plan-offers] > summary")  # the plan's offers
                assert await page.locator("tr[data-plan-stage]").count() == 3
                assert await page.locator("tr[data-offer]").count() == 3
                ARTIFACTS.mkdir(exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "layout_pipeline.png"), full_page=True)
                return await page.evaluate(NODE_IDS_JS), problems
            finally:
                await browser.close()

    size, problems = asyncio.run(look())
    assert size["width"] <= WIDTH and size["wrapped"] == 0 and size["nodeids"] >= 3, size
    assert problems == []
