"""Compute classes, precision and homogeneous redundancy (issue 14, items 1-3).

Pure parts (class keys, precision resolution, the spec, the trainer's precisions, the policy's
cross-class rule) with real torch; the hub parts against the real app over loopback with
protocol-speaking nodes (tests/helpers.SimNode) and the real node agent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import pytest
import torch
from gpuflex.hub.policy import round_policy as policy
from gpuflex.hub.policy.distances import relative_distance
from gpuflex.hub.policy.reputation import Reputation
from gpuflex.hub.policy.update_record import UpdateRecord
from gpuflex.node.assignment import check_assignment
from gpuflex.node.device import compute_class, supported_precisions
from gpuflex.node.errors import AssignmentRejected
from gpuflex.node.trainer import LossScaler, train_assignment
from gpuflex.protocol.compute import auto_precision, class_key, precision_problem, resolve_precision
from gpuflex.protocol.errors import DecodeError, SpecError
from gpuflex.protocol.jobspec import VerificationSpec, parse_job_spec
from gpuflex.protocol.messages import (
    UNKNOWN_CLASS,
    Assignment,
    ComputeClass,
    Hello,
    NoWork,
    decode_message,
    encode_message,
    nested_from_dict,
    nested_to_dict,
)

from tests.helpers import (
    SimNode,
    finish_job,
    open_store,
    start_hub,
    submit_job,
    write_digits,
)
from tests.tooling import attacks as atk

CPU = ComputeClass("cpu", "AMD EPYC", "", "AuthenticAMD", ("avx2", "avx512f", "fma"), "2.13.0+cpu", "", "",
                   True, 1, ("fp32", "bf16"))
A100 = ComputeClass("cuda", "NVIDIA A100-SXM4-80GB", "8.0", "GenuineIntel", ("avx2",), "2.13.0+cu128", "12.8",
                    "91002", True, 8, ("fp32", "tf32", "bf16", "fp16"))
T4 = dataclasses.replace(A100, device_model="Tesla T4", capability="7.5", precisions=("fp32", "fp16"))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- protocol


def test_class_key_is_one_string_per_class_and_changes_with_every_numerics_part() -> None:
    assert class_key(CPU, "fp32") == class_key(dataclasses.replace(CPU), "fp32")
    variants = [
        dataclasses.replace(CPU, threads=2),
        dataclasses.replace(CPU, onednn=False),
        dataclasses.replace(CPU, isa=("avx2", "fma")),
        dataclasses.replace(CPU, cpu_vendor="GenuineIntel"),
        dataclasses.replace(CPU, torch_version="2.12.0+cpu"),
    ]
    keys = {class_key(CPU, "fp32"), class_key(CPU, "bf16"), *(class_key(v, "fp32") for v in variants)}
    assert len(keys) == 2 + len(variants)
    # a flag that does not change numerics (and the order flags come in) does not split a class
    assert class_key(dataclasses.replace(CPU, isa=("fma", "sse4_2", "avx512f", "avx2")), "fp32") == class_key(CPU, "fp32")
    # CUDA: the device and its software stack count, the host's thread count does not
    assert class_key(dataclasses.replace(A100, threads=1), "bf16") == class_key(A100, "bf16")
    for other in (dataclasses.replace(A100, cudnn_version="90100"), dataclasses.replace(A100, capability="8.6"),
                  dataclasses.replace(A100, device_model="NVIDIA A100-PCIE-40GB")):
        assert class_key(other, "bf16") != class_key(A100, "bf16")
    assert "|" not in class_key(dataclasses.replace(CPU, cpu_vendor="a|b"), "fp32").split("|")[1]


def test_auto_resolves_to_each_devices_fastest_precision_and_unsupported_ones_to_none() -> None:
    assert (auto_precision(A100), auto_precision(T4), auto_precision(CPU)) == ("bf16", "fp16", "fp32")
    assert resolve_precision(CPU, "auto") == "fp32" and class_key(CPU, "auto") == class_key(CPU, "fp32")
    assert class_key(A100, "auto") == class_key(A100, "bf16")
    assert resolve_precision(dataclasses.replace(CPU, precisions=("bf16",)), "auto") == "bf16"
    assert resolve_precision(CPU, "fp16") is None and resolve_precision(T4, "bf16") is None
    assert resolve_precision(CPU, "bf16") == "bf16"
    assert precision_problem(CPU, "fp16") == "precision fp16 is not supported on this cpu device (it trains fp32, bf16)"
    assert precision_problem(CPU, "bf16") is None


def test_this_machines_class_is_reported_honestly() -> None:
    cc = compute_class(torch.device("cpu"))
    assert cc.device_kind == "cpu" and cc.threads == torch.get_num_threads() == 1
    assert cc.precisions == supported_precisions(torch.device("cpu")) == ("fp32", "bf16")
    assert cc.torch_version == torch.__version__ and cc.onednn == torch.backends.mkldnn.enabled
    assert compute_class(torch.device("cpu"), precisions=("bf16", "fp16")).precisions == ("bf16",)


def test_a_compute_class_travels_in_the_signed_hello_and_hostile_values_fail() -> None:
    hello = Hello("0.1", 2, atk_device(), atk_bench(), time.time(), b"n" * 16, compute=A100)
    back = decode_message(encode_message(hello), Hello)
    assert back.compute == A100 and back.benchmark.precision_sps == {"fp32": 100.0, "bf16": 350.0}
    assert nested_from_dict(ComputeClass, nested_to_dict(A100)) == A100
    wire = nested_to_dict(A100)
    for field, bad, why in (
        ("precisions", ["fp32", "fp8"], "expected one of"),
        ("precisions", ["fp32"] * 5, "longer than"),
        ("isa", ["AVX 2"], "does not match"),
        ("device_kind", "tpu", "expected one of"),
        ("threads", -1, "outside"),
        ("onednn", 1, "true or false"),
    ):
        with pytest.raises(DecodeError, match=why):
            nested_from_dict(ComputeClass, wire | {field: bad})
    with pytest.raises(DecodeError, match="missing field 'onednn'"):
        nested_from_dict(ComputeClass, {k: v for k, v in wire.items() if k != "onednn"})


def atk_device():
    from gpuflex.protocol.messages import DeviceInfo

    return DeviceInfo(kind="cuda", name="NVIDIA A100-SXM4-80GB", memory_bytes=80 << 30, threads=8)


def atk_bench():
    from gpuflex.protocol.messages import Benchmark

    return Benchmark(100.0, 19.5, 312.0, 312.0, 2000.0, 25.0, 25.0, "mlp-64-128-10/b32",
                     precision_sps={"fp32": 100.0, "bf16": 350.0})


def test_job_spec_precision_and_cross_class_tolerance() -> None:
    base = '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 4\nhidden = [3]\noutputs = 2\n'
    spec = parse_job_spec(base)
    assert spec.train.precision == "auto" and spec.verification.cross_class_tolerance == 0.2
    assert spec.train.train_config().precision == "fp32"  # "auto" without a node: fp32
    assert spec.train.train_config("bf16").precision == "bf16"
    bf16 = parse_job_spec(base + '[train]\nprecision = "bf16"\n[verification]\ncross_class_tolerance = 0.1\n')
    assert bf16.train.train_config().precision == "bf16" and bf16.verification.cross_class_tolerance == 0.1
    with pytest.raises(SpecError, match=r"train.precision: expected one of auto, fp32, tf32, bf16, fp16, got 'fp8'"):
        parse_job_spec(base + '[train]\nprecision = "fp8"\n')
    with pytest.raises(SpecError, match="cross_class_tolerance: must be at least tolerance"):
        parse_job_spec(base + "[verification]\ntolerance = 0.01\ncross_class_tolerance = 0.001\n")


# --------------------------------------------------------------------------- node


def _digits_round(precision: str, epochs: int = 3) -> tuple[dict[str, torch.Tensor], float, float]:
    xtr, ytr, xva, yva = atk.digits_data()
    spec = atk.digits_spec()
    state = atk.initial_state(spec)
    cfg = atk.train_config(local_epochs=epochs, precision=precision)
    result = train_assignment(spec, state, atk.make_chunks(xtr, ytr), cfg, 5, device=torch.device("cpu"))
    return result.delta, atk.accuracy(spec, atk.apply_delta(state, result.delta), xva, yva), result.loss


def test_bf16_on_the_cpu_trains_to_the_fp32_accuracy_and_repeats_bit_for_bit() -> None:
    bf16, acc_bf16, _ = _digits_round("bf16")
    again, _, _ = _digits_round("bf16")
    fp32, acc_fp32, _ = _digits_round("fp32")
    assert acc_bf16 >= 0.9 and abs(acc_bf16 - acc_fp32) <= 0.02, (acc_bf16, acc_fp32)
    assert all(t.dtype == torch.float32 for t in bf16.values()), "master weights stay fp32"
    assert relative_distance(bf16, again)[0] == 0.0, "one class, one result"
    d = relative_distance(bf16, fp32)[0]
    assert VerificationSpec().tolerance < d < VerificationSpec().cross_class_tolerance, d


def test_the_fp16_path_with_loss_scaling_trains_too() -> None:
    """fp16 is not offered on a CPU (no fast kernels), but its code path (autocast + loss scaling,
    what a CUDA node runs) trains the digits MLP to the fp32 accuracy here as well."""
    delta, acc, loss = _digits_round("fp16")
    _, acc_fp32, _ = _digits_round("fp32")
    assert acc >= acc_fp32 - 0.02 and loss < 0.5, (acc, acc_fp32, loss)
    assert all(t.dtype == torch.float32 for t in delta.values())


def test_fp16_loss_scaling_skips_an_overflowing_step_and_backs_off() -> None:
    scaler = LossScaler(torch.device("cpu"), init_scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([8.0, 16.0, 24.0])
    assert scaler.unscale([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    scaler.update()
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert not scaler.unscale([p])
    scaler.update()
    assert float(scaler.scale) == 4.0
    for _ in range(2):
        p.grad = torch.ones(3)
        assert scaler.unscale([p])
        scaler.update()
    assert float(scaler.scale) == 8.0


def test_a_node_refuses_an_assignment_in_a_precision_it_does_not_train() -> None:
    cfg = atk.train_config(precision="fp16")
    spec = atk.digits_spec()
    from gpuflex.protocol.modelspec import manifest
    from gpuflex.protocol.tensors import ITEMSIZE

    size = sum(int(torch.Size(t.shape).numel()) * int(ITEMSIZE[t.dtype]) for t in manifest(spec))
    a = Assignment("a-1", "j-1", 0, "gf1-me", "0" * 64, size, spec.to_dict(), (), 1, cfg, time.time(),
                   time.time() + 60, "")
    with pytest.raises(AssignmentRejected, match=r"^assignment a-1 asks for precision fp16; this node trains only fp32, bf16$"):
        check_assignment(a, node_id="gf1-me", now=time.time(), seen=(), cache_cap_bytes=1 << 30,
                         precisions=("fp32", "bf16"))


# --------------------------------------------------------------------------- policy


def _cnn_delta(onednn: bool) -> dict[str, torch.Tensor]:
    from gpuflex.protocol.modelspec import ModelSpec

    spec = ModelSpec.from_dict({"kind": "cnn", "image": [1, 8, 8], "channels": [16, 32], "kernel": 3,
                                "pool": "max", "hidden": [64], "outputs": 10})
    xtr, ytr, _, _ = atk.digits_data()
    chunks = atk.make_chunks(xtr.reshape(-1, 1, 8, 8), ytr)[:11]
    torch.backends.mkldnn.enabled = onednn
    try:
        return train_assignment(spec, atk.initial_state(spec), chunks, atk.train_config(local_epochs=3), 7,
                                device=torch.device("cpu")).delta
    finally:
        torch.backends.mkldnn.enabled = True


def test_an_honest_cross_class_pair_is_judged_by_the_cross_class_tolerance_not_the_strict_one() -> None:
    """oneDNN on vs off: the digits CNN's honest replicas land ~1e-2 apart (bench/class_distance.py)."""
    on, off = _cnn_delta(True), _cnn_delta(False)
    d = relative_distance(on, off)[0]
    spec = VerificationSpec()
    assert spec.tolerance < d < spec.cross_class_tolerance, d
    records = [UpdateRecord(update_id=f"u{i}", node_id=f"n{i}", shard_id="s", samples_claimed=704,
                            shard_samples=704, loss=0.5, train_s=1.0, node_samples_per_s=1e4, delta=delta)
               for i, delta in enumerate((on, off))]
    trusted = {f"n{i}": Reputation(consecutive_agreements=50, agreements_total=50) for i in range(2)}
    keys = {"n0": class_key(CPU, "fp32"), "n1": class_key(dataclasses.replace(CPU, onednn=False), "fp32")}
    assert policy.comparison_of(keys.values()) == "cross_class"
    assert policy.comparison_of([keys["n0"], keys["n0"], None]) == "same_class"
    cross = policy.decide_shard(records, spec, policy.ReplicaState(wanted=2, comparison="cross_class",
                                                                   class_keys=keys), trusted)
    assert isinstance(cross, policy.Settle) and cross.flags == () and set(cross.agreed_nodes) == {"n0", "n1"}
    assert cross.evidence["comparison"] == "cross_class" and cross.evidence["class_keys"] == keys
    assert cross.evidence["tolerance"] == spec.cross_class_tolerance
    assert cross.evidence["strict_tolerance"] == spec.tolerance
    # the same pair judged as one class: the strict tolerance splits it (no majority of two)
    strict = policy.decide_shard(records, spec, policy.ReplicaState(wanted=2), trusted)
    assert isinstance(strict, policy.WaitForMore) and strict.evidence["comparison"] == "same_class"


# --------------------------------------------------------------------------- hub (real app, loopback)


def _spec_with(spec_path, **train: str) -> None:
    text = spec_path.read_text()
    extra = "".join(f'{k} = "{v}"\n' for k, v in train.items())
    spec_path.write_text(text.replace("local_epochs = 1\n", "local_epochs = 1\n" + extra))


async def _nodes(s, hub) -> dict[str, dict]:
    async with s.get(f"{hub.url}/v1/nodes", headers=hub.auth(hub.auditor_token)) as r:
        assert r.status == 200
        return {n["id"]: n for n in (await r.json())["nodes"]}


async def test_the_class_is_stored_and_shown_in_v1_nodes_and_survives_a_restart(tmp_path) -> None:
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            node = SimNode(s, hub.url, compute=A100)
            await node.register()
            shown = (await _nodes(s, hub))[node.node_id]
            assert nested_from_dict(ComputeClass, shown["compute_class"]) == A100
            assert shown["class_keys"] == {p: class_key(A100, p) for p in A100.precisions}
            legacy = SimNode(s, hub.url)  # says nothing of its class
            await legacy.register()
            assert (await _nodes(s, hub))[legacy.node_id]["compute_class"]["device_kind"] == "unknown"
        tokens = {"owner": hub.owner_token, "auditor": hub.auditor_token, "admin": hub.admin_token}
    finally:
        await hub.stop()
    hub = await start_hub(tmp_path / "hub", tokens=tokens)
    try:
        async with aiohttp.ClientSession() as s:
            assert (await _nodes(s, hub))[node.node_id]["class_keys"]["bf16"] == class_key(A100, "bf16")
    finally:
        await hub.stop()


async def test_a_job_in_a_precision_the_node_cannot_train_is_not_handed_to_it(tmp_path) -> None:
    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    _spec_with(spec, precision="fp16")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            cpu = SimNode(s, hub.url, compute=CPU)
            await cpu.register()
            answer = await cpu.work(0.3)
            assert isinstance(answer, NoWork)
            assert answer.reason == ("every running job asks for a precision this node cannot train (fp16); "
                                     "it trains fp32, bf16")
            gpu = SimNode(s, hub.url, compute=T4)  # fp16 is what a T4 trains
            await gpu.register()
            a = await gpu.work(0.5)
            assert isinstance(a, Assignment) and a.train.precision == "fp16" and a.job_id == job_id
            assert isinstance(await cpu.work(0.2), NoWork), "still nothing for the CPU"
    finally:
        await hub.stop()


async def test_auto_is_resolved_per_node_into_the_signed_assignment_and_sizes_its_shard(tmp_path) -> None:
    train, val, spec = write_digits(tmp_path / "d", rounds=1, round_target_s=1.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            await submit_job(s, hub, spec, train, val)
            # benchmark: 100 samples/s in fp32, 400 in bf16; round_target_s 1 caps a shard at 1 s of work
            a100 = SimNode(s, hub.url, compute=A100, samples_per_s=100.0)
            hello = a100.hello()
            a100.hello = lambda **over: dataclasses.replace(  # type: ignore[method-assign]
                hello, benchmark=dataclasses.replace(hello.benchmark, precision_sps={"fp32": 100.0, "bf16": 400.0}),
                timestamp=time.time(), nonce=__import__("os").urandom(16), **over)
            await a100.register()
            a = await a100.work(0.5)
            assert isinstance(a, Assignment) and a.train.precision == "bf16"
            assert 400 <= sum(c.samples for c in a.chunks) < 400 + 64, "sized by the bf16 figure"
    finally:
        await hub.stop()


async def test_a_replica_goes_to_a_node_of_the_same_class_first_then_cross_class(tmp_path) -> None:
    """Two nodes of one class and one of another: the other-class node polls first and gets no
    replica while the same-class node is online; the same-class node gets it. With a short
    replica wait, a cross-class node gets the replica once half of it has passed."""
    other = dataclasses.replace(CPU, onednn=False)
    for wait_s, cross_after in ((30.0, None), (1.0, 0.5)):
        train, val, spec = write_digits(tmp_path / f"d{wait_s}", rounds=1, replication='"adaptive"',
                                        replica_wait_s=wait_s)
        hub = await start_hub(tmp_path / f"hub{wait_s}")
        try:
            async with aiohttp.ClientSession() as s:
                await submit_job(s, hub, spec, train, val)
                a, b, c = SimNode(s, hub.url, compute=CPU), SimNode(s, hub.url, compute=CPU), SimNode(s, hub.url, compute=other)
                for n in (a, b, c):
                    await n.register()
                first = await a.work(0.5)  # alone in its gathering: every chunk, replicated (untrusted)
                assert isinstance(first, Assignment) and hub.replica_group(first.assignment_id)
                if cross_after is None:
                    assert isinstance(await c.work(0.3), NoWork), "no replica for the other class"
                    second = await b.work(0.5)
                    assert isinstance(second, Assignment) and hub.replica_group(second.assignment_id) == hub.replica_group(first.assignment_id)
                else:
                    await asyncio.sleep(cross_after + 0.05)
                    second = await c.work(0.5)
                    assert isinstance(second, Assignment) and hub.replica_group(second.assignment_id) == hub.replica_group(first.assignment_id)
        finally:
            await hub.stop()


async def test_honest_replicas_of_two_classes_are_compared_cross_class_and_not_flagged(tmp_path) -> None:
    """A node that trains bf16 (it offers only bf16) and one that trains fp32 hold every replica
    of an "auto" job: their updates differ by ~1e-2 (far beyond the strict tolerance), the referee
    replays a committed segment of each in its own precision and both reproduce: nobody is flagged,
    and the round says which groups were cross-class."""
    train, val, spec = write_digits(tmp_path / "d", rounds=2, replication="1.0", replica_wait_s=30.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            job_id = (await (await submit_job(s, hub, spec, train, val)).json())["id"]
            fp32 = SimNode(s, hub.url, compute=CPU)
            bf16 = SimNode(s, hub.url, compute=dataclasses.replace(CPU, precisions=("bf16",)))
            for n in (fp32, bf16):
                await n.register()
            for _ in range(2):
                got: dict[str, Assignment] = {}
                give_up = time.monotonic() + 30
                while len(got) < 2:  # each hands over the states the referee asks of it meanwhile
                    assert time.monotonic() < give_up, "the round never opened for both nodes"
                    for n in (fp32, bf16):
                        if n.node_id not in got and isinstance(a := await n.work(0.3), Assignment):
                            got[n.node_id] = a
                a1, a2 = got[fp32.node_id], got[bf16.node_id]
                assert (a1.train.precision, a2.train.precision) == ("fp32", "bf16")
                assert hub.replica_group(a1.assignment_id) == hub.replica_group(a2.assignment_id)
                blobs = [await n.train(a) for n, a in ((fp32, a1), (bf16, a2))]
                for n, a, (blob, samples, loss) in ((fp32, a1, blobs[0]), (bf16, a2, blobs[1])):
                    assert (await n.upload(a, blob, samples, loss)).ok
            doc = await finish_job(s, hub, job_id, [fp32, bf16])
            for h in doc["history"]:
                assert h["flags"] == [] and sorted(u["status"] for u in h["updates"]) == ["included", "redundant"]
                assert list(h["replica_comparison"].values()) == ["cross_class"]
            rounds = hub_rows(hub, "SELECT evidence FROM rounds WHERE job_id = ? ORDER BY round", job_id)
            import json

            for (evidence,) in rounds:
                assert set(json.loads(evidence)["replica_comparison"].values()) == {"cross_class"}
            async with s.get(f"{hub.url}/v1/audit-log", headers=hub.auth(hub.auditor_token)) as r:
                entries = [json.loads(line) for line in (await r.text()).splitlines()]
            aggs = [e["body"] for e in entries if e["kind"] == "aggregation"]
            assert len(aggs) == 2
            for body in aggs:
                assert body["replica_comparison"] == {sha: "cross_class" for sha in body["included"]}
            (outcome,) = hub_rows(hub, "SELECT outcome FROM shards WHERE job_id = ? AND round = 0", job_id)
            shard = json.loads(outcome[0])
            # beyond the strict tolerance, so the referee replayed a segment of each: both reproduce
            assert shard["comparison"] == "cross_class" and 1e-4 < shard["pairs"][0]["relative_distance"] < 0.2
            assert {(r["precision"], r["outcome"]) for r in shard["referee"]} == {("fp32", "reproduced"),
                                                                                 ("bf16", "reproduced")}
    finally:
        await hub.stop()


def hub_rows(hub, sql, *args):

    conn = open_store(hub.data_dir)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


async def test_the_node_refuses_a_held_assignment_it_can_no_longer_train_and_says_why(tmp_path) -> None:
    """A node took a bf16 assignment, then restarts offering only fp32 (--precisions fp32): the hub
    hands it the assignment it still holds; the node refuses it with a one-line reason, hands it
    back, and the hub gives it no more work of that job, saying why."""
    from test_node_support import EventLog, agent, wait_for

    train, val, spec = write_digits(tmp_path / "d", rounds=1)
    _spec_with(spec, precision="bf16")
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            await submit_job(s, hub, spec, train, val)
            from gpuflex.protocol.signing import SigningKey

            (tmp_path / "node").mkdir(mode=0o700)
            key = SigningKey.load_or_create(tmp_path / "node" / "node.key")  # the agent's identity
            before = SimNode(s, hub.url, key=key, compute=compute_class(torch.device("cpu")))
            await before.register()
            held = await before.work(0.5)
            assert isinstance(held, Assignment) and held.train.precision == "bf16"
            events = EventLog()
            node = agent(tmp_path / "node", hub.url, events, precisions=("fp32",))
            assert node.node_id == key.fingerprint
            task = asyncio.create_task(node.run())
            try:
                rejected = await wait_for(lambda: events.of("rejected"), timeout=20)
                assert rejected[0]["detail"] == (f"assignment {held.assignment_id} asks for precision bf16; "
                                                 "this node trains only fp32")
                no_work = await wait_for(lambda: events.of("no_work"), timeout=20)
                assert "cannot train (bf16)" in no_work[0]["reason"]
            finally:
                node.request_exit("test")
                await asyncio.wait_for(task, 20)
            (row,) = hub_rows(hub, "SELECT state FROM assignments WHERE id = ?", held.assignment_id)
            assert row[0] == "abandoned", "handed back at once, not left to expire"
    finally:
        await hub.stop()


def test_unknown_class_is_fp32_only_and_never_a_class_of_its_own() -> None:
    from gpuflex.hub.model.node import NodeState

    n = NodeState(id="n", public_key=b"k", bench_sps=1.0, ema_sps=1.0, last_seen=0.0)
    assert n.compute == UNKNOWN_CLASS and n.class_key("auto") is None and n.precision_for("bf16") is None
    assert n.precision_for("auto") == "fp32" and n.precision_factor("bf16") == 1.0


# --------------------------------------------------------------------------- real processes


@pytest.mark.e2e
@pytest.mark.one_store  # numeric classes on real nodes; the store calls are the in-process tests'
def test_real_nodes_in_two_classes_train_bf16_and_fp32_side_by_side_and_nobody_is_flagged(tmp_path) -> None:
    """A hub and two `gpuflex-node run` processes: one offers only bf16 (--precisions bf16), the
    other runs with oneDNN off. An "auto" job: the first trains bf16, the second fp32, so every
    replica group is cross-class. The job reaches a sensible accuracy, nobody is flagged, and
    /v1/nodes and `gpuflex-node status` show each node's class."""
    import json
    import subprocess
    import sys

    from gpuflex.hub.ops import owner_client as oc

    from tests.tooling.cluster import LocalCluster, digits_job

    with LocalCluster(workdir=tmp_path, hub_args=("--long-poll-max", "2", "--min-deadline", "4")) as cluster:
        cluster.start_hub()
        bf16 = cluster.start_node("bf16", extra=("--precisions", "bf16"))
        no_onednn = cluster.start_node("no-onednn", extra=("--onednn", "off"))
        cluster.wait_registered()
        token = cluster.create_token("owner", "alice")
        files = digits_job(tmp_path / "job", rounds=4, local_epochs=3, replication=1.0, round_target_s=2.0)
        job_id = str(asyncio.run(oc.submit_job(cluster.url, token, files.spec, files.train, files.val))["id"])
        status = cluster.wait_job(job_id, token, timeout_s=240)
        assert status["state"] == "done", status
        assert status["history"][-1]["accuracy"] >= 0.9, status["history"][-1]
        assert all(h["flags"] == [] for h in status["history"])
        auditor = cluster.create_token("auditor", "audrey")
        nodes = {n["id"]: n for n in cluster.get_json("/v1/nodes", auditor)["nodes"]}
        assert nodes[bf16.node_id]["compute_class"]["precisions"] == ["bf16"]
        assert nodes[no_onednn.node_id]["compute_class"]["onednn"] is False
        assert nodes[bf16.node_id]["class_keys"]["bf16"].endswith("|bf16")
        trained = {e.get("assignment_id") for e in bf16.events() if e.get("event") == "trained"}
        assert trained, "the bf16 node trained"
        evidence = [json.loads(r["evidence"]) for r in cluster.rows(
            "SELECT evidence FROM rounds WHERE job_id = ? ORDER BY round", job_id)]
        compared = [c for e in evidence for c in e.get("replica_comparison", {}).values()]
        assert compared and set(compared) == {"cross_class"}
        for proc, expect in ((bf16, "trains bf16"), (no_onednn, "oneDNN off")):
            out = subprocess.run([sys.executable, "-m", "gpuflex.node", "status", "--data-dir", str(proc.data_dir)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert expect in out.stdout and "class key" in out.stdout, out.stdout


async def test_the_consoles_nodes_page_shows_the_class_its_keys_and_the_speed_per_precision(tmp_path) -> None:
    import html as html_lib

    from tests.test_console_helpers import Browserish

    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            node = SimNode(s, hub.url, compute=A100)
            hello = node.hello()
            node.hello = lambda **over: dataclasses.replace(  # type: ignore[method-assign]
                hello, benchmark=atk_bench(), timestamp=time.time(), nonce=__import__("os").urandom(16), **over)
            await node.register()
        browser = Browserish(hub.url)
        try:
            await browser.login(hub.auditor_token)
            status, page, _ = await browser.get("/console/nodes")
        finally:
            await browser.close()
        assert status == 200
        text = html_lib.unescape(page)
        assert "sm 8.0 · CUDA 12.8 · cuDNN 91002 · torch 2.13.0+cu128" in text
        assert "trains fp32, tf32, bf16, fp16" in text
        assert f"bf16: {class_key(A100, 'bf16')}" in text
        assert "bf16 350 samples/s" in text
    finally:
        await hub.stop()
