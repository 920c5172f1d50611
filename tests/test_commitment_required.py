"""Verification is not optional for the one verified (hub/policy/referee.py ``commitment_refusal``),
on a real hub over loopback with its SQLite store.

Where the job may ask the referee (its assignments say ``train.commit``), an update whose header
carries no checkpoint commitment, or one that does not cover the assignment's steps, is refused
in one line before a byte of it is stored, and the assignment stays live for a committed upload.
A job that never asks the referee takes updates without one. The colluder of the issue (x3.5, no
commitment, its replica partner stalling) is replayed with the production defences in
tests/test_sybil.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp
from gpuflex.protocol.messages import Assignment

from tests.helpers import SimNode, open_store, start_hub, submit_job, wait_job, write_digits


async def _refused(
    n: SimNode, a: Assignment, blob: bytes, samples: int, loss: float, **over: object
) -> tuple[int, dict]:
    resp = await n.upload_raw(n.update_header(a, blob, samples, loss, **over), blob)
    return resp.status, await resp.json()


def _rows(hub_dir: Path, sql: str, params: tuple = ()) -> list[tuple]:
    conn = open_store(hub_dir)
    try:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


async def test_an_uncommitted_update_is_refused_where_the_referee_may_ask_and_its_assignment_stays_live(
    tmp_path: Path,
) -> None:
    train, val, spec = write_digits(tmp_path / "d", rounds=1, replication='"adaptive"')
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            assert (await submit_job(s, hub, spec, train, val)).status == 201
            node = SimNode(s, hub.url)
            await node.register()
            a = await node.work(2.0)
            assert isinstance(a, Assignment) and a.train.commit
            blob, samples, loss = await node.train(a)
            committed = node.commitments[a.assignment_id]
            status, body = await _refused(node, a, blob, samples, loss, commitment=None)
            assert (status, body["error"]) == (400, "commitment_required"), body
            assert "\n" not in body["detail"] and "commit" in body["detail"]
            short = dataclasses.replace(committed, steps=committed.steps - 1)
            status, body = await _refused(node, a, blob, samples, loss, commitment=short)
            assert (status, body["error"]) == (400, "bad_commitment"), body
            # nothing of it was stored, and the assignment is still the node's to deliver
            assert _rows(hub.data_dir, "SELECT id FROM updates") == []
            assert _rows(
                hub.data_dir, "SELECT state FROM assignments WHERE id = ?", (a.assignment_id,)
            ) == [("live",)]
            assert (
                await node.upload(a, blob, samples, loss)
            ).ok  # with the commitment its training recorded
            assert len(_rows(hub.data_dir, "SELECT id FROM updates")) == 1
    finally:
        await hub.stop()


async def test_a_job_that_never_asks_the_referee_takes_updates_without_a_commitment(
    tmp_path: Path,
) -> None:
    train, val, spec = write_digits(tmp_path / "d", rounds=1)  # no replication, no spot check
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            node = SimNode(s, hub.url)
            await node.register()
            a = await node.work(2.0)
            assert isinstance(a, Assignment) and not a.train.commit
            blob, samples, loss = await node.train(a)
            assert a.assignment_id not in node.commitments
            assert (await node.upload(a, blob, samples, loss)).ok
            doc = await wait_job(s, hub, job_id, timeout=30)
            assert [u["status"] for u in doc["history"][0]["updates"]] == ["included"]
    finally:
        await hub.stop()
