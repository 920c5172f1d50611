"""Console parts that need no hub: SVG charts and the session store."""

from __future__ import annotations

import math
from pathlib import Path

from gpuflex.hub.server.console import charts
from gpuflex.hub.server.console.sessions import SessionStore, csrf_matches


def test_line_chart_escapes_and_skips_gaps():
    svg = charts.line_chart(
        [
            charts.Series("<b>loss</b>", [(0, 1.0), (1, None), (2, math.nan), (3, 0.5)]),
            charts.Series("acc", [(0, 0.1), (3, 0.9)]),
        ],
        title='t"<script>',
    )
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert "<script>" not in svg and "<b>" not in svg
    assert "&lt;b&gt;loss&lt;/b&gt;" in svg and "t&quot;&lt;script&gt;" in svg
    assert "nan" not in svg.lower().replace("nan</", "")  # no NaN coordinates
    assert svg.count("<circle") == 4
    assert "no data yet" in charts.line_chart([], title="x")
    assert "no data yet" in charts.line_chart([charts.Series("a", [(0, None)])], title="x")


def test_bar_chart_and_gauge_escape():
    svg = charts.bar_chart(
        [charts.Bar("<layer>", [1.0, -0.5]), charts.Bar("b", [math.inf, 2.0])],
        title="T",
        legend=["this", "<centre>"],
        threshold=1.5,
    )
    assert "<layer>" not in svg and "&lt;layer&gt;" in svg and "&lt;centre&gt;" in svg
    assert "inf" not in svg
    g = charts.score_gauge(-0.9, 0.0, bad_when="below", title="cos")
    assert 'class="bad"' in g
    g = charts.score_gauge(1.0, 4.0, bad_when="above", title="ratio")
    assert 'class="ok"' in g


def test_nice_ticks():
    assert charts.nice_ticks(0, 1) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    t = charts.nice_ticks(0.13, 2.27)
    assert t[0] <= 0.13 and t[-1] >= 2.27 and len(t) <= 12
    assert charts.nice_ticks(5, 5)  # degenerate range still gives ticks
    assert charts.nice_ticks(math.nan, 1) == []


def test_session_store_expires_and_checks_csrf(tmp_path: Path):
    now = [1000.0]
    store = SessionStore(tmp_path / "s.sqlite3", ttl_s=100, idle_s=30, clock=lambda: now[0])
    sid, s = store.create(token_id="1", role="owner", name="alice")
    assert store.get(sid).name == "alice"
    assert store.get("nope") is None and store.get(None) is None
    assert csrf_matches(s.csrf, s.csrf) and not csrf_matches(s.csrf, s.csrf[:-1] + "x")
    assert not csrf_matches(s.csrf, None) and not csrf_matches(s.csrf, "")
    now[0] += 31  # idle too long
    assert store.get(sid) is None
    sid, _ = store.create(token_id="1", role="owner", name="alice")
    for _ in range(3):
        now[0] += 25  # active: each use refreshes the idle clock
        assert store.get(sid) is not None
    now[0] += 25  # past the absolute lifetime (100 s)
    assert store.get(sid) is None
    store.close()


def test_layer_profile_against_centre():
    import torch
    from gpuflex.hub.server.readmodel.evidence import layer_profile

    centre = {"w": torch.tensor([[3.0, 4.0]]), "b": torch.tensor([1.0]), "n": torch.tensor(7)}
    update = {"w": -centre["w"].clone(), "b": torch.tensor([0.0]), "n": torch.tensor(1)}
    before = {k: v.clone() for k, v in update.items()}
    rows = layer_profile(update, centre)
    assert [r["name"] for r in rows] == ["w", "b"]  # integer tensors skipped, order kept
    assert rows[0]["norm"] == 5.0 and rows[0]["centre_norm"] == 5.0
    assert math.isclose(rows[0]["cosine"], -1.0)
    assert rows[1]["cosine"] == 0.0  # a zero layer has no direction
    assert all(torch.equal(update[k], before[k]) for k in update)
    assert layer_profile(update, centre, max_layers=1) == rows[:1]


def test_sessions_survive_a_restart_and_die_with_their_token(tmp_path: Path):
    store = SessionStore(tmp_path / "console.sqlite3")
    sid, s = store.create(token_id="7", role="auditor", name="audrey")
    other, _ = store.create(token_id="8", role="owner", name="alice")
    store.close()
    store = SessionStore(tmp_path / "console.sqlite3")  # a restarted hub
    again = store.get(sid)
    assert again is not None and again.csrf == s.csrf and again.role == "auditor"
    store.delete_for_token("7")
    assert store.get(sid) is None and store.get(other) is not None
    store.delete(other)
    assert store.get(other) is None
    store.close()


def _replication_db(path: Path):
    """A hub database (the hub's own schema) holding one closed round of two shards of 100
    samples, each planned as a replica group of 2: shard s1 was trained once (its second
    assignment expired), shard s2 twice."""
    from gpuflex.hub.storage.db import connect

    conn = connect(path / "hub.sqlite3")
    conn.execute("INSERT INTO jobs (id, owner, name, spec_toml, state, round, rounds, model_hash, model_size,"
                 " train_samples, val_samples, created_at, updated_at)"
                 " VALUES ('j1', 'alice', 'job', '', 'done', 1, 1, 'm', 10, 200, 10, 0, 0)")
    conn.execute("INSERT INTO rounds (job_id, round, model_hash, opened_at, closed_at) VALUES ('j1', 0, 'm', 0, 10)")
    for idx in (0, 1):
        conn.execute("INSERT INTO chunks (job_id, idx, sha, samples, size) VALUES ('j1', ?, ?, 100, 1)",
                     (idx, f"c{idx}"))
    copies = {"s1": [("done", True), ("expired", False)], "s2": [("done", True), ("done", True)]}
    for seq, (sid, assignments) in enumerate(copies.items()):
        conn.execute("INSERT INTO shards (id, job_id, round, seq, seed, samples, replica_group, wanted, state)"
                     " VALUES (?, 'j1', 0, ?, 1, 100, ?, 2, 'settled')", (sid, seq, f"g-{sid}"))
        conn.execute("INSERT INTO shard_chunks VALUES (?, 0, ?, ?)", (sid, seq, f"c{seq}"))
        for n, (state, returned) in enumerate(assignments):
            aid = f"a-{sid}-{n}"
            conn.execute("INSERT INTO assignments (id, shard_id, job_id, round, node_id, issued_at, expected_s,"
                         " deadline, state, sealed) VALUES (?, ?, 'j1', 0, ?, 1, 1, 5, ?, x'')",
                         (aid, sid, f"node-{n}", state))
            if returned:
                conn.execute("INSERT INTO updates (id, assignment_id, shard_id, job_id, round, node_id, sha, size,"
                             " sample_count, loss, train_s, metrics, timings, status, received_at)"
                             " VALUES (?, ?, ?, 'j1', 0, ?, 'u', 1, 100, 0.5, 1, '{}', '{}', 'included', 2)",
                             (f"u-{aid}", aid, sid, f"node-{n}"))
    return conn


def test_a_shard_counts_as_replicated_only_when_trained_twice(tmp_path: Path):
    """The job page's replication line, its shard map's copies and the read model's shards agree:
    a replica group whose second copy never came back is one copy, not a replicated shard."""
    from gpuflex.hub.server.console.routes import _job_context
    from gpuflex.hub.server.readmodel import jobs

    conn = _replication_db(tmp_path)
    try:
        row = conn.execute("SELECT * FROM jobs WHERE id = 'j1'").fetchone()
        doc = jobs.job_status(conn, row, None)
        extras = jobs.job_extras(conn, "j1", "done", 1, 0)
    finally:
        conn.close()
    (entry,) = doc["history"]
    assert {sh["shard_id"]: sh["replicated"] for sh in entry["shards"]} == {"s1": False, "s2": True}
    assert entry["replication_overhead"] == 0.5  # 300 samples trained for 200
    assert [(sh["id"], sh["copies"], sh["wanted"]) for sh in extras["shards"]] == [("s1", 1, 2), ("s2", 2, 2)]
    overhead = _job_context({"doc": doc, **extras}, review=False)["overhead"]
    assert (overhead["total"], overhead["replicated"], overhead["shards"]) == (0.5, 1, 2)


def test_a_flags_headline_names_the_check_it_failed():
    """evidence.headline on the evidence shapes hub/policy/verification.py and hub/policy/referee.py record."""
    from gpuflex.hub.server.readmodel.evidence import headline

    replay = {"update": "u-1", "node": "gf1-a", "steps": [12, 24], "threshold": 0.15, "outcome": "mismatch",
              "distance": 2.47, "precision": "bf16"}
    assert headline({"update_id": "u-1", "reason": "referee_mismatch", "evidence": {"referee": replay}}) == (
        "referee: re-executed segment (steps 12-24) ended 2.47 from the committed state (must be ≤ 0.15)")
    untrue = {"update": "u-1", "outcome": "mismatch", "steps": [0, 8], "threshold": 0.001,
              "why": "the committed norm of steps 0-4 is 1.5; its states are 0.25 apart"}
    assert headline({"update_id": "u-1", "evidence": {"referee": untrue}}) == f"referee: {untrue['why']}"
    unverifiable = {"update": "u-1", "outcome": "unverifiable", "why": "state of step 8 not handed over"}
    assert headline({"update_id": "u-1", "evidence": {"referee": unverifiable}}) == (
        "referee: state of step 8 not handed over")
    # a replica that agreed with an update the referee failed: that update's check
    vouched = {"vouched_for": "u-1", "relative_distance": 0.0, "referee": replay}
    assert headline({"update_id": "u-2", "evidence": vouched}) == (
        "agreed with u-1 (relative distance 0), which failed the referee: re-executed segment (steps 12-24)"
        " ended 2.47 from the committed state (must be ≤ 0.15)")
    # the plain rules: every score beyond its threshold, and only those
    outlier = {"cosine": -0.99, "norm_ratio": 1.1, "update_norm": 2.0}
    assert headline({"reason": "outlier", "evidence": outlier, "round_evidence": {"cosine_min": 0.0}}) == (
        "cosine to round centre -0.99 (must be ≥ 0)")
    assert headline({"reason": "implausible", "evidence": {"problems": ["claims 900 samples of 200"]}}) == (
        "claims 900 samples of 200")
