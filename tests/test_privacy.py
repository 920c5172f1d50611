"""Differential privacy for node-local jobs (issue 18): ``[privacy] dp = "central"``.

The hub clips each silo's update, averages them with equal weights and adds Gaussian noise
(hub/policy/privacy.py); its accountant reports the job's (ε, δ) in the job's status. Here: the spec's
rules, the accountant against the exact privacy profile of the Gaussian mechanism, the clip, the
noise's distribution, and jobs over a real hub (tests/test_silos.py's pattern: SimNodes train
digits silos) with little noise (the model learns) and with a great deal (it does not).
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import time
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from gpuflex.hub.policy.aggregation import aggregate, update_norm
from gpuflex.hub.policy.privacy import (
    add_noise,
    clip_factor,
    epsilon,
    noise_std,
    rdp_epsilon,
    secure_generator,
)
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.jobspec import AggregationSpec, PrivacySpec, parse_job_spec
from gpuflex.protocol.messages import Assignment, NoWork
from gpuflex.protocol.tensors import encode_state
from scipy.special import log_ndtr, ndtr
from sklearn.datasets import load_digits

from tests.helpers import SimNode, start_hub
from tests.tooling.partition import dirichlet_split

SPEC = """
[job]
name = "private silos"
[model]
kind = "mlp"
input = 64
hidden = [32]
outputs = 10
[train]
rounds = {rounds}
local_epochs = 2
batch_size = 32
lr = 0.1
seed = 3
[data]
source = "node-local"
min_samples = 20
max_samples = 1000
quorum = 3
round_deadline_s = 60
"""


def spec(rounds: int = 3, privacy: str = 'dp = "central"\n', extra: str = "") -> str:
    return SPEC.format(rounds=rounds) + extra + "[privacy]\n" + privacy


# -- the spec ------------------------------------------------------------------------------------


def test_privacy_defaults_off_and_central_takes_its_keys():
    assert parse_job_spec(SPEC.format(rounds=3)).privacy == PrivacySpec()
    assert not PrivacySpec().central
    p = parse_job_spec(spec(privacy='dp = "central"\nclip_norm = 0.5\nnoise_multiplier = 0\n'
                                    'delta = 1e-6\n')).privacy
    assert (p.dp, p.central, p.clip_norm, p.noise_multiplier, p.delta) == ("central", True, 0.5, 0.0, 1e-6)
    p = parse_job_spec(spec()).privacy
    assert (p.clip_norm, p.noise_multiplier, p.delta) == (1.0, 1.0, 1e-5)
    assert parse_job_spec(spec(privacy='dp = "off"\n')).privacy == PrivacySpec()


HUB_JOB = '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [4]\noutputs = 2\n'


@pytest.mark.parametrize(("text", "message"), [
    (spec(privacy='dp = "local"\n'), "privacy.dp: expected one of off, central"),
    (spec(privacy='clip_norm = 2.0\n'), 'privacy.clip_norm: only with dp = "central"'),
    (spec(privacy='dp = "off"\nnoise_multiplier = 1.0\n'), 'privacy.noise_multiplier: only with dp = "central"'),
    (spec(privacy='dp = "off"\nepsilon = 1.0\n'), "privacy.'epsilon': unknown key; allowed: clip_norm, delta, dp"),
    (spec(privacy='dp = "central"\nepsilon = 1.0\n'), "privacy.'epsilon': unknown key"),
    (spec(privacy='dp = "central"\nclip_norm = 0\n'), r"privacy.clip_norm: expected a number in \(0, 1e\+12\]"),
    (spec(privacy='dp = "central"\nnoise_multiplier = -1\n'), "privacy.noise_multiplier: expected a number in"),
    (spec(privacy='dp = "central"\ndelta = 1.0\n'), r"privacy.delta: expected a number in \(0, 1\), got 1.0"),
    (spec(privacy='dp = "central"\ndelta = 0\n'), r"privacy.delta: expected a number in \(0, 1\)"),
    (HUB_JOB + '[privacy]\ndp = "central"\n', 'privacy.dp: central differential privacy is for .*"node-local"'),
    (spec(extra='[aggregation]\nmethod = "median"\n'), "privacy.dp: central differential privacy averages with"
                                                        " fedavg, not median"),
    (spec(extra="[aggregation]\nclip_norm = 3.0\n"), "aggregation.clip_norm: \\[privacy\\] clip_norm replaces it"),
])
def test_privacy_spec_mistakes_are_one_line_errors(text, message):
    with pytest.raises(SpecError, match=message) as info:
        parse_job_spec(text)
    assert "\n" not in str(info.value)


def test_central_dp_takes_a_server_optimizer_and_an_explicit_zero_clip():
    s = parse_job_spec(spec(extra='[aggregation]\nclip_norm = 0\nserver_optimizer = "fedadam"\n'))
    assert s.privacy.central and s.aggregation == AggregationSpec(server_optimizer="fedadam")


# -- the accountant ------------------------------------------------------------------------------


def exact_epsilon(z: float, rounds: int, delta: float) -> float:
    """The exact ε at δ of ``rounds`` compositions of the Gaussian mechanism (sensitivity 1, noise
    z): one Gaussian of noise z / √rounds, whose privacy profile is (Balle & Wang 2018, Thm. 8)
    δ(ε) = Φ(-ε z' + 1/(2 z')) - e^ε Φ(-ε z' - 1/(2 z')); decreasing in ε, solved by bisection."""
    zr = z / math.sqrt(rounds)

    def profile(eps: float) -> float:
        return float(ndtr(-eps * zr + 0.5 / zr) - math.exp(eps + log_ndtr(-eps * zr - 0.5 / zr)))

    lo, hi = 0.0, 1.0
    while profile(hi) > delta:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if profile(mid) > delta else (lo, mid)
    return hi


CASES = [(z, t) for z in (0.5, 1.0, 2.0, 5.0, 20.0) for t in (1, 10, 30, 100, 1000)]


@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_the_rdp_bound_holds_and_is_close_to_the_exact_gaussian_epsilon(delta):
    for z, t in CASES:
        bound, exact = epsilon(t, z, delta), exact_epsilon(z, t, delta)
        standard = rdp_epsilon(t, z, delta, "standard")[0]
        assert exact <= bound <= standard, (z, t, exact, bound, standard)
        assert bound <= 1.25 * exact + 0.05, (z, t, exact, bound)
    # the numbers quoted in hub/policy/privacy.py
    assert (round(epsilon(30, 1.0, 1e-5), 1), round(rdp_epsilon(30, 1.0, 1e-5, "standard")[0], 1),
            round(exact_epsilon(1.0, 30, 1e-5), 1)) == (39.8, 41.3, 37.6)


def test_the_standard_conversion_reaches_its_closed_form_optimum():
    for z, t in CASES:
        log_inv = math.log(1e5)
        closed = t / (2 * z * z) + math.sqrt(2 * t * log_inv) / z
        if 1 + z * math.sqrt(2 * log_inv / t) <= 10_000:
            assert rdp_epsilon(t, z, 1e-5, "standard")[0] == pytest.approx(closed, rel=1e-9)


def test_epsilon_grows_with_rounds_falls_with_noise_and_has_no_bound_without_noise():
    by_rounds = [epsilon(t, 1.0, 1e-5) for t in (1, 2, 5, 10, 50, 100, 1000)]
    assert by_rounds == sorted(by_rounds) and len(set(by_rounds)) == len(by_rounds)
    by_noise = [epsilon(30, z, 1e-5) for z in (0.3, 0.5, 1.0, 2.0, 5.0, 50.0)]
    assert by_noise == sorted(by_noise, reverse=True) and len(set(by_noise)) == len(by_noise)
    assert epsilon(30, 50.0, 1e-5) < 1.0 < epsilon(30, 5.0, 1e-5)
    assert epsilon(10, 1.0, 1e-3) < epsilon(10, 1.0, 1e-5)  # a larger δ buys a smaller ε
    assert epsilon(1, 0.0, 1e-5) == math.inf
    assert epsilon(0, 1.0, 1e-5) == 0.0 and epsilon(0, 0.0, 1e-5) == 0.0
    for bad in [(-1, 1.0, 1e-5), (1, -0.1, 1e-5), (1, 1.0, 0.0), (1, 1.0, 1.0), (1, math.nan, 1e-5)]:
        with pytest.raises(ValueError):
            rdp_epsilon(*bad)


# -- the mechanism -------------------------------------------------------------------------------


def test_an_update_ten_times_the_clip_counts_as_one_at_the_clip():
    g = torch.Generator().manual_seed(0)
    u = {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g), "n": torch.tensor(3)}
    norm = update_norm(u)
    unit = {k: (v / norm if v.is_floating_point() else v) for k, v in u.items()}  # norm 1
    big = {k: (v * 10 if v.is_floating_point() else v) for k, v in unit.items()}  # norm 10
    other = {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g), "n": torch.tensor(3)}
    small = {k: (v * 0.5 / update_norm(other) if v.is_floating_point() else v) for k, v in other.items()}  # norm 0.5
    assert update_norm(big) == pytest.approx(10.0) and clip_factor(update_norm(big), 1.0) == pytest.approx(0.1)
    assert clip_factor(update_norm(small), 1.0) == 1.0 and clip_factor(0.0, 1.0) == 1.0
    spec = AggregationSpec()
    scales = [clip_factor(update_norm(d), 1.0) for d in (big, small)]
    clipped = aggregate([big, small], [1.0, 1.0], spec, scales=scales)
    as_unit = aggregate([unit, small], [1.0, 1.0], spec)
    for k in ("w", "b"):
        torch.testing.assert_close(clipped[k], as_unit[k], rtol=1e-6, atol=1e-7)
    unclipped = aggregate([big, small], [1.0, 1.0], spec)
    assert not torch.allclose(unclipped["w"], as_unit["w"])
    for bad in [(math.inf, 1.0), (-1.0, 1.0), (1.0, 0.0)]:
        with pytest.raises(ValueError):
            clip_factor(*bad)


def test_the_noise_has_the_calibrated_standard_deviation():
    z, clip, n = 1.3, 2.0, 4
    std = noise_std(z, clip, n)
    assert std == pytest.approx(0.65)
    delta = {"w": torch.zeros(1000, 1000), "b": torch.zeros(1000, dtype=torch.float64),
             "steps": torch.zeros(3, dtype=torch.int64)}
    add_noise(delta, std)
    w = delta["w"].double()
    # 1M coordinates: the sample std's relative standard error is 1/sqrt(2M) = 0.07 %; ±3 % is 40 of them
    assert abs(float(w.std()) / std - 1.0) < 0.03
    assert abs(float(w.mean())) < 6 * std / 1000.0
    assert abs(float(delta["b"].std()) / std - 1.0) < 0.2 and delta["b"].dtype == torch.float64
    assert torch.equal(delta["steps"], torch.zeros(3, dtype=torch.int64))  # not a floating tensor
    # a fresh draw each time (the seed comes from `secrets`); a given generator is the one used
    again = {"w": torch.zeros(1000)}
    add_noise(again, std)
    assert not torch.equal(again["w"], delta["w"].view(-1)[:1000])
    a, b = {"w": torch.zeros(10)}, {"w": torch.zeros(10)}
    add_noise(a, 1.0, torch.Generator().manual_seed(7))
    add_noise(b, 1.0, torch.Generator().manual_seed(7))
    assert torch.equal(a["w"], b["w"])
    assert secure_generator().initial_seed() != secure_generator().initial_seed()
    zero = {"w": torch.ones(5)}
    add_noise(zero, 0.0)
    assert torch.equal(zero["w"], torch.ones(5))
    with pytest.raises(ValueError):
        add_noise(zero, -1.0)


# -- jobs over a real hub ------------------------------------------------------------------------


def digits() -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)


def silo_blob(x: np.ndarray, y: np.ndarray) -> bytes:
    return encode_state({"x": torch.from_numpy(np.ascontiguousarray(x)), "y": torch.from_numpy(np.ascontiguousarray(y))})


def npz(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


async def _serve(node: SimNode, job: str, stop: asyncio.Event) -> None:
    """A node that trains each assignment it gets on its own silo until ``stop``."""
    from gpuflex.protocol.signing import seal

    from tests.helpers import b64

    while not stop.is_set():
        got = await node.work(0.3)
        if isinstance(got, NoWork):
            continue
        assert isinstance(got, Assignment) and got.job_id == job
        blob, samples, loss = await node.train(got)
        hdr = node.update_header(got, blob, samples, loss)
        async with node.session.post(f"{node.url}/v1/updates", data=blob, headers={
                "Content-Type": "application/octet-stream", "X-GPUFlex-Update": b64(seal(node.key, hdr))}) as r:
            assert r.status == 200, await r.text()


async def run_job(tmp_path: Any, text: str, views: dict[str, Any] | None = None) -> dict[str, Any]:
    """Submit ``text`` to a fresh hub, let three nodes train their Dirichlet(0.5) digits silos
    until the job ends; its status document. ``views``, when given, gets what each side sees of
    the finished job: the owner's status as raw JSON text and its console page, the admin's
    status, and the nodes' ids."""
    hub = await start_hub(tmp_path, long_poll_max_s=0.3)
    x, y = digits()
    val = np.arange(0, len(y), 6)
    rest = np.setdiff1d(np.arange(len(y)), val)
    parts = [rest[p] for p in dirichlet_split(y[rest], 3, 0.5, seed=1, min_size=60)]
    headers = {"Authorization": f"Bearer {hub.owner_token}"}
    try:
        async with aiohttp.ClientSession() as session:
            form = aiohttp.FormData()
            form.add_field("spec", text.encode(), filename="spec.toml")
            form.add_field("val", npz(x[val], y[val]), filename="val.npz")
            async with session.post(f"{hub.url}/v1/jobs", data=form, headers=headers) as r:
                assert r.status == 201, await r.text()
                job = (await r.json())["id"]
            nodes = [SimNode(session, hub.url) for _ in parts]
            for node, idx in zip(nodes, parts, strict=True):
                await node.register()
                assert (await node.attach_silo(job, silo_blob(x[idx], y[idx]), len(idx))).status == 200
            stop = asyncio.Event()
            tasks = [asyncio.create_task(_serve(n, job, stop)) for n in nodes]
            give_up = time.monotonic() + 120
            while True:
                async with session.get(f"{hub.url}/v1/jobs/{job}", headers=headers) as r:
                    assert r.status == 200, await r.text()
                    doc: dict[str, Any] = await r.json()
                if doc["state"] != "running" or time.monotonic() > give_up:
                    break
                await asyncio.sleep(0.2)
            stop.set()
            await asyncio.gather(*tasks)
            if views is not None:
                views["nodes"] = [n.node_id for n in nodes]
                async with session.get(f"{hub.url}/v1/jobs/{job}", headers=headers) as r:
                    views["owner_json"] = await r.text()
                async with session.get(f"{hub.url}/v1/jobs/{job}", headers=hub.auth(hub.admin_token)) as r:
                    views["admin"] = await r.json()
                from tests.test_console_helpers import Browserish

                browser = Browserish(hub.url)
                try:
                    await browser.login(hub.owner_token)
                    status, html, _ = await browser.get(f"/console/jobs/{job}")
                    assert status == 200, html[:300]
                    views["owner_html"] = html
                finally:
                    await browser.close()
    finally:
        await hub.stop()
    assert doc["state"] == "done", doc.get("error")
    return doc


def _shown_to_owner(views: dict[str, Any]) -> dict[str, Any]:
    """The owner's status (from its raw text) once no node id appears in that text or in the
    owner's console page."""
    for node in views["nodes"]:
        assert node not in views["owner_json"] and node not in views["owner_html"], node
    return json.loads(views["owner_json"])  # type: ignore[no-any-return]


@pytest.mark.asyncio
async def test_a_private_job_reports_its_epsilon_and_learns_under_little_noise_but_not_under_much(tmp_path):
    rounds, clip = 8, 1.0
    docs = {}
    views: dict[str, Any] = {}
    for z in (0.1, 50.0):
        docs[z] = await run_job(tmp_path / f"z{z}", spec(
            rounds=rounds, privacy=f'dp = "central"\nclip_norm = {clip}\nnoise_multiplier = {z}\ndelta = 1e-5\n'),
            views=views if z == 0.1 else None)
    # what central DP hides from the owner (who sees the published models): which node took part,
    # and any silo's or update's count, loss or timing; the admin, the hub's own side, sees them
    owner = _shown_to_owner(views)
    assert owner["redacted"].startswith("central differential privacy")
    assert sorted(s["node_id"] for s in owner["silos"]) == ["silo-1", "silo-2", "silo-3"]
    assert all(s["samples"] is None and s["blob"] is None for s in owner["silos"])
    for h in owner["history"]:
        assert {u["node_id"] for u in h["updates"]} == {"silo-1", "silo-2", "silo-3"}
        assert all(u["loss"] is None and u["samples"] is None for u in h["updates"])
        assert h["node_shares"] == {} and all(sh["samples"] is None for sh in h["shards"])
        assert h["train_loss"] is not None and h["accuracy"] is not None
    admin = views["admin"]
    assert "redacted" not in admin and {s["node_id"] for s in admin["silos"]} == set(views["nodes"])
    assert all(u["loss"] is not None for h in admin["history"] for u in h["updates"])
    assert "Not shown" in views["owner_html"] and "central differential privacy" in views["owner_html"]
    for z, doc in docs.items():
        assert doc["privacy"] == {
            "mechanism": "central gaussian, fixed clipping", "clip_norm": clip, "noise_multiplier": z,
            "delta": 1e-5, "rounds": rounds, "epsilon": epsilon(rounds, z, 1e-5),
            "epsilon_at_end": epsilon(rounds, z, 1e-5)}
        assert len(doc["history"]) == rounds
        for h in doc["history"]:
            assert [u["status"] for u in h["updates"]] == ["included"] * 3
            dp = h["privacy"]
            assert (dp["clip_norm"], dp["noise_multiplier"], dp["updates"]) == (clip, z, 3)
            assert dp["noise_std"] == pytest.approx(z * clip / 3)
            assert 0 <= dp["clipped"] <= 3  # a count: which update, and its norm, stay hidden
            assert "probe" not in h  # no per-update loss change from the owner's validation set either
    # two local epochs of lr 0.1 move the digits MLP by more than the clip: the first round's
    # updates are clipped
    assert docs[0.1]["history"][0]["privacy"]["clipped"] >= 1
    learned = [h["accuracy"] for h in docs[0.1]["history"]]
    drowned = [h["accuracy"] for h in docs[50.0]["history"]]
    assert learned[-1] > 0.7, learned  # chance is 0.1
    assert max(drowned) < 0.35, drowned
    assert epsilon(rounds, 0.1, 1e-5) > 100 and epsilon(rounds, 50.0, 1e-5) < 0.3  # what each bought


def test_job_status_prints_the_privacy_line():
    from gpuflex.hub.ops.cli import _status_view
    from rich.console import Console

    doc = {"id": "j-1", "name": "x", "state": "running", "round": 3, "rounds": 8, "history": [],
           "privacy": {"mechanism": "central gaussian, fixed clipping", "clip_norm": 1.0, "noise_multiplier": 1.1,
                       "delta": 1e-5, "rounds": 3, "epsilon": epsilon(3, 1.1, 1e-5),
                       "epsilon_at_end": epsilon(8, 1.1, 1e-5)}}
    console = Console(width=300, record=True)
    console.print(_status_view(doc))
    text = console.export_text()
    assert f"privacy: ε = {epsilon(3, 1.1, 1e-5):.3g} at δ = 1e-05 after 3 rounds (central gaussian" in text
    assert f"ε = {epsilon(8, 1.1, 1e-5):.3g} after all 8" in text
    console = Console(width=300, record=True)
    console.print(_status_view({k: v for k, v in doc.items() if k != "privacy"}))
    assert "privacy" not in console.export_text()


def test_the_owner_view_hides_silos_from_the_owner_only_and_job_status_prints_what_is_not_shown():
    from gpuflex.hub.ops.cli import _status_view
    from gpuflex.hub.server.readmodel.redaction import owner_view
    from gpuflex.hub.storage.tokens import Principal
    from rich.console import Console

    up = {"update_id": "u-1", "node_id": "gf1-aaaa", "chunks": 1, "samples": 120, "loss": 0.5, "status": "included",
          "replica_group": "", "verified_by": {"replicas": ["gf1-bbbb"]}}
    doc = {"id": "j-1", "name": "x", "state": "done", "round": 1, "rounds": 1,
           "silos": [{"node_id": "gf1-aaaa", "samples": 120, "blob": "ab" * 32, "size": 4000, "label_histogram": None,
                      "attached_at": 1.0}],
           "history": [{"round": 0, "loss": 1.0, "accuracy": 0.5, "train_loss": 0.7, "updates": [up],
                        "flags": [{"flag_id": "f-1", "node_id": "gf1-aaaa", "reason": "outlier", "status": "open"}],
                        "shards": [{"shard_id": "s0", "samples": 120, "chunks": 1, "replicated": False,
                                    "nodes": ["gf1-aaaa"], "train_s": 1.0, "elapsed_s": 1.2}],
                        "node_shares": {"gf1-aaaa": 1.0}, "parallel": {"nodes": 1, "shards": 1, "balance": 1.0}}]}
    dp = parse_job_spec(spec(privacy='dp = "central"\nclip_norm = 1.0\nnoise_multiplier = 1.0\n'))
    sa = parse_job_spec(spec(privacy="secure_aggregation = true\n"))
    plain = parse_job_spec(spec(privacy=""))
    owner, admin, auditor = (Principal(1, "owner", "alice"), Principal(2, "admin", "root"),
                             Principal(3, "auditor", "eve"))
    before = json.dumps(doc)
    for who in (admin, auditor):
        assert owner_view(doc, dp, who) is doc  # the hub's own side sees everything
    assert owner_view(doc, plain, owner) is doc and owner_view(doc, None, owner) is doc
    hidden = owner_view(doc, dp, owner)
    assert "gf1-aaaa" not in json.dumps(hidden) and json.dumps(doc) == before  # a copy is redacted
    assert "gf1-bbbb" not in json.dumps(hidden)  # nor who verified an update
    assert hidden["silos"][0]["node_id"] == hidden["history"][0]["updates"][0]["node_id"] == "silo-1"
    assert hidden["history"][0]["flags"][0]["node_id"] == "silo-1" and hidden["history"][0]["node_shares"] == {}
    assert hidden["history"][0]["train_loss"] == 0.7 and hidden["history"][0]["updates"][0]["loss"] is None
    summed = owner_view(doc, sa, owner)
    assert summed["history"][0]["updates"][0] == up | {"loss": None} and summed["silos"] == doc["silos"]
    console = Console(width=300, record=True)
    console.print(_status_view(hidden))
    text = console.export_text()
    assert "silos: 1 attached (the rows stay on their nodes)" in text
    assert "not shown: central differential privacy: nodes are pseudonyms" in text
