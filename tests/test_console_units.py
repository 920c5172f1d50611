"""Console parts that need no hub: SVG charts and the session store."""

from __future__ import annotations

import math
from pathlib import Path

from gpuflex.hub.web import charts
from gpuflex.hub.web.sessions import SessionStore, csrf_matches


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
    from gpuflex.hub.web.evidence import layer_profile

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
