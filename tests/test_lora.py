"""LoRA with int8 frozen weights (protocol/finetune.py, protocol/lora.py): the settings refused in
one line, the model built alike from plain data, and a job trained end to end on a real hub over
loopback (real SQLite) by simulated nodes with the real trainer: the updates carry only the
adapters, the hub aggregates them and keeps the base frozen, the referee replays a node's
segment and reproduces it, the validation loss falls and the owner downloads the merged model."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from gpuflex.hub.policy.referee import judge_segment
from gpuflex.node.checkpoints import CheckpointRecorder, CheckpointStore
from gpuflex.node.trainer import train_assignment
from gpuflex.protocol.checkpoint import auto_every
from gpuflex.protocol.errors import SpecError, TensorError
from gpuflex.protocol.jobspec import VerificationSpec, parse_job_spec
from gpuflex.protocol.lora import LoraLinear, dequantize, lora_state, merged_model, quantize_rows
from gpuflex.protocol.messages import Assignment
from gpuflex.protocol.modelfile import load_safetensors_model
from gpuflex.protocol.modelspec import (
    ModelSpec,
    build_for_state,
    build_model,
    manifest,
    update_manifest,
)
from gpuflex.protocol.tensors import decode_state, encode_state, state_to_safetensors

from tests.helpers import (
    SimNode,
    digits_arrays,
    digits_spec,
    finish_job,
    open_store,
    start_hub,
    stored_blobs,
    submit_job,
    write_digits,
)

LORA = '[train]\nfinetune = "lora"\nlora_rank = 4\nlora_alpha = 8\nfrozen_precision = "int8"\n'
MLP = '[job]\nname = "x"\n[model]\nkind = "mlp"\ninput = 64\nhidden = [128]\noutputs = 10\n'
TRANSFORMER = (
    '[job]\nname = "lm"\n[model]\nkind = "transformer"\nvocab = 32\ncontext = 8\nlayers = 2\n'
    "width = 32\nheads = 2\n"
)


def spec_names(spec: ModelSpec) -> list[str]:
    return [t.name for t in manifest(spec)]


def lora_digits_spec(**kw: object) -> str:
    """The tests' digits job, its [train] a LoRA fine-tune."""
    return digits_spec(**kw).replace("[train]\n", LORA, 1)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            'lora_targets = ["attn"]',
            "train.lora_targets: 'attn' names no Linear layer of this model",
        ),
        (
            "lora_rank = 10",
            "train.lora_rank: 10 is not below the smaller side of layer '2' (128 -> 10)",
        ),
        ("lora_rank = 0", "train.lora_rank: expected an integer 1..4096, got 0"),
        (
            'frozen_precision = "int4"',
            "train.frozen_precision: expected one of int8, fp32, got 'int4'",
        ),
        ("lora_alpha = -1", "train.lora_alpha: expected a number > 0, got -1"),
    ],
)
def test_bad_lora_settings_are_refused_in_one_line(extra: str, says: str) -> None:
    text = MLP + '[train]\nfinetune = "lora"\n' + extra + "\n"
    with pytest.raises(SpecError) as err:
        parse_job_spec(text)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (MLP + "[train]\nlora_rank = 4\n", 'train.lora_rank: only with finetune = "lora"'),
        (MLP + '[train]\nfinetune = "qlora"\n', "train.finetune: expected one of full, lora"),
        (
            MLP.replace("outputs = 10\n", "outputs = 10\nlora = {rank = 4}\n") + LORA,
            "model.lora: LoRA is set in [train]",
        ),
        (
            MLP
            + LORA
            + '[data]\nsource = "node-local"\nquorum = 3\n[privacy]\nsecure_aggregation = true\n',
            'train.finetune: "lora" with [privacy] secure_aggregation is not supported',
        ),
    ],
)
def test_lora_with_what_it_cannot_work_with_is_refused(text: str, says: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_job_spec(text)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_transformer_targets_name_layer_kinds_and_the_update_carries_only_adapters() -> None:
    spec = parse_job_spec(TRANSFORMER + LORA + 'lora_targets = ["attn", "mlp"]\n').model
    assert spec.lora is not None and ModelSpec.from_dict(spec.to_dict()) == spec
    carried = [t.name for t in update_manifest(spec)]
    assert carried == [
        f"blocks.{i}.{part}.{ab}"
        for i in range(2)
        for part in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
        for ab in ("lora_a", "lora_b")
    ]
    dtypes = {t.name: t.dtype for t in manifest(spec)}
    assert (
        dtypes["blocks.0.attn.qkv.weight_q"] == "int8" and "blocks.0.attn.qkv.weight" not in dtypes
    )
    only_attn = parse_job_spec(TRANSFORMER + LORA + 'lora_targets = ["blocks.*.attn.qkv"]\n').model
    assert [t.name for t in update_manifest(only_attn)] == [
        f"blocks.{i}.attn.qkv.lora_{ab}" for i in range(2) for ab in "ab"
    ]


def test_int8_rows_round_trip_within_half_a_step_and_the_model_is_built_alike() -> None:
    w = torch.randn(16, 40)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    assert ((dequantize(q, scale) - w).abs() <= scale.unsqueeze(1) / 2 + 1e-7).all()
    spec = parse_job_spec(MLP + LORA).model
    a, b = build_model(spec, 7).state_dict(), build_model(spec, 7).state_dict()
    assert list(a) == [t.name for t in manifest(spec)] and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["0.lora_a"], build_model(spec, 8).state_dict()["0.lora_a"]
    )  # keyed by the seed
    assert not a["0.lora_b"].any()  # B = 0: the untrained LoRA model is the (quantized) base
    model = build_for_state(spec, a)
    assert isinstance(model[0], LoraLinear)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "0.lora_a",
        "0.lora_b",
        "2.lora_a",
        "2.lora_b",
    ]


@pytest.mark.parametrize("frozen", ["int8", "fp32"])
def test_a_trained_update_is_the_adapters_and_merging_keeps_the_function(frozen: str) -> None:
    spec = parse_job_spec(MLP + LORA.replace('"int8"', f'"{frozen}"')).model
    assert ("0.weight_q" in spec_names(spec)) == (frozen == "int8") and (
        "0.weight" in spec_names(spec)
    ) == (frozen == "fp32")
    state = build_model(spec, 0).state_dict()
    x, y, _, _ = digits_arrays()
    chunk = {"x": torch.from_numpy(x[:256]), "y": torch.from_numpy(y[:256])}
    cfg = parse_job_spec(
        MLP + LORA + 'local_epochs = 2\noptimizer = "adam"\nlr = 0.01\n'
    ).train.train_config()
    res = train_assignment(spec, state, [chunk], cfg, 3, device=torch.device("cpu"))
    assert (
        list(res.delta) == [t.name for t in update_manifest(spec)]
        and res.delta["0.lora_b"].abs().sum() > 0
    )
    trained = {k: v + res.delta[k] if k in res.delta else v for k, v in state.items()}
    plain, merged = merged_model(spec, trained)
    assert plain.lora is None and list(merged) == [t.name for t in manifest(plain)]
    xs = chunk["x"][:64]
    with torch.no_grad():
        torch.testing.assert_close(
            build_for_state(plain, merged)(xs),
            build_for_state(spec, trained)(xs),
            rtol=1e-5,
            atol=1e-5,
        )


def test_a_pretrained_base_becomes_the_lora_state_quantized_with_its_other_tensors_kept() -> None:
    spec = parse_job_spec(TRANSFORMER + LORA + 'lora_targets = ["mlp"]\n').model
    plain = dataclasses.replace(spec, lora=None)
    base = build_model(plain, 5).state_dict()
    state = lora_state(spec, base)
    assert list(state) == [t.name for t in manifest(spec)]
    assert torch.equal(state["embed.tok"], base["embed.tok"])
    assert torch.equal(
        state["blocks.0.attn.qkv.weight"], base["blocks.0.attn.qkv.weight"]
    )  # not a target
    q, scale = quantize_rows(base["blocks.1.mlp.fc.weight"])
    assert torch.equal(state["blocks.1.mlp.fc.weight_q"], q) and torch.equal(
        state["blocks.1.mlp.fc.weight_scale"], scale
    )
    merged = merged_model(spec, state)[1]  # B = 0: the merged model is the dequantized base
    torch.testing.assert_close(
        merged["blocks.1.mlp.fc.weight"],
        base["blocks.1.mlp.fc.weight"],
        atol=float(scale.max()) / 2 + 1e-7,
        rtol=0.0,
    )
    with pytest.raises(TensorError):
        lora_state(spec, {k: v for k, v in base.items() if k != "embed.tok"})


async def test_a_lora_job_trains_end_to_end_the_hub_aggregates_adapters_and_the_referee_reproduces(
    tmp_path: Path,
) -> None:
    """Two simulated nodes, four rounds, every untrusted update spot-checked (spot_check = 1)."""
    train, val, _ = write_digits(tmp_path / "d")
    spec_text = lora_digits_spec(rounds=4, chunk_size=256, spot_check=1.0)
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            r = await submit_job(s, hub, spec_text, train, val)
            assert r.status == 201, await r.text()
            job_id = (await r.json())["id"]
            nodes = [SimNode(s, hub.url) for _ in range(2)]
            for n in nodes:
                await n.register()
            first = await nodes[0].work(2.0)
            assert isinstance(first, Assignment)
            trained = await nodes[0].train(first)
            assert list(decode_state(bytearray(trained[0]))) == [
                t.name for t in update_manifest(ModelSpec.from_dict(first.model_spec))
            ]
            # the hub knows a LoRA update's layout: a whole-model update is refused, nothing stored
            whole = decode_state(bytearray(await nodes[0].blob(first.model_hash)))
            blob = encode_state({k: torch.zeros_like(v) for k, v in whole.items()})
            refused = await nodes[0].upload_raw(nodes[0].update_header(first, blob, 1, 1.0), blob)
            assert refused.status == 422, await refused.text()
            await nodes[0].upload(first, *trained)
            doc = await finish_job(s, hub, job_id, nodes, timeout=120.0)
            assert doc["state"] == "done", doc
            losses = [h["loss"] for h in doc["history"]]
            async with s.get(
                f"{hub.url}/v1/jobs/{job_id}/model", headers=hub.auth(hub.owner_token)
            ) as got:
                assert got.status == 200
                model_file = await got.read()
        assert len(losses) == 4 and losses[-1] < losses[0] * 0.8, losses
        conn = open_store(hub.data_dir)
        try:
            verdicts = [
                row[0] for row in conn.execute("SELECT status FROM state_requests").fetchall()
            ]
            hashes = [
                row[0]
                for row in conn.execute(
                    "SELECT sha FROM models WHERE job_id = ? ORDER BY version", (job_id,)
                ).fetchall()
            ]
        finally:
            conn.close()
        assert verdicts and set(verdicts) == {"reproduced"}, verdicts
        blobs = stored_blobs(hub.data_dir)
        initial, final = (decode_state(bytearray(blobs[h])) for h in (hashes[0], hashes[-1]))
        for name, t in initial.items():  # the frozen base is the initial one, bit for bit
            assert torch.equal(t, final[name]) == (not name.endswith((".lora_a", ".lora_b"))), name
        path = tmp_path / "model.safetensors"
        path.write_bytes(model_file)
        plain = load_safetensors_model(path)
        assert not any(isinstance(m, LoraLinear) for m in plain.modules())
    finally:
        await hub.stop()


async def test_an_owners_base_model_is_frozen_under_the_adapters_and_a_base_that_does_not_fit_is_refused(
    tmp_path: Path,
) -> None:
    """POST /v1/jobs with a part ``base`` (a .safetensors file of the spec's plain model): the
    job's round-0 model is that base, its targeted weights quantized; a base of another shape is
    refused in one line and no job is made."""
    train, val, _ = write_digits(tmp_path / "d")
    spec_text = lora_digits_spec(rounds=1, chunk_size=256)
    spec = parse_job_spec(spec_text).model
    base = build_model(dataclasses.replace(spec, lora=None), 11).state_dict()
    good, bad = tmp_path / "base.safetensors", tmp_path / "bad.safetensors"
    good.write_bytes(state_to_safetensors(base))
    bad.write_bytes(state_to_safetensors({**base, "0.weight": torch.zeros(128, 63)}))
    hub = await start_hub(tmp_path / "hub")
    try:
        async with aiohttp.ClientSession() as s:
            for path, status in ((bad, 422), (good, 201)):
                form = aiohttp.FormData()
                form.add_field("spec", spec_text.encode(), filename="spec.toml")
                form.add_field("train", train.read_bytes(), filename="train.npz")
                form.add_field("val", val.read_bytes(), filename="val.npz")
                form.add_field("base", path.read_bytes(), filename=path.name)
                async with s.post(f"{hub.url}/v1/jobs", data=form, headers=hub.auth()) as r:
                    doc = await r.json()
                    assert r.status == status, doc
            assert doc["model_hash"]
        initial = decode_state(bytearray(stored_blobs(hub.data_dir)[doc["model_hash"]]))
        q, scale = quantize_rows(base["0.weight"])
        assert torch.equal(initial["0.weight_q"], q) and torch.equal(
            initial["0.weight_scale"], scale
        )
        assert torch.equal(initial["2.bias"], base["2.bias"])
        assert torch.equal(
            initial["0.lora_a"], build_model(spec, 0).state_dict()["0.lora_a"]
        )  # the job's seed
        conn = open_store(hub.data_dir)
        try:
            assert conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 1
        finally:
            conn.close()
    finally:
        await hub.stop()


def _committed_lora_training(tmp: Path) -> tuple[Any, ...]:
    """A LoRA job's assignment trained with checkpoint commitments (the node's recorder)."""
    job = parse_job_spec(
        MLP + LORA + 'local_epochs = 2\nbatch_size = 32\noptimizer = "adam"\nlr = 0.01\n'
    )
    xtr, ytr, _, _ = digits_arrays()
    x, y = torch.from_numpy(xtr[:320].copy()), torch.from_numpy(ytr[:320].copy())
    cfg = job.train.train_config()
    state = build_model(job.model, seed=0).state_dict()
    total = math.ceil(320 / cfg.batch_size) * cfg.local_epochs
    store = CheckpointStore(tmp / "ckpt")
    rec = CheckpointRecorder(
        total_steps=total, every=auto_every(total), store=store, assignment_id="as-1"
    )
    res = train_assignment(
        job.model, state, [{"x": x, "y": y}], cfg, 5, device=torch.device("cpu"), on_step=rec
    )
    commitment = rec.commitment()
    states = {s: dict(decode_state(bytearray(store.read("as-1", s) or b""))) for s in rec.steps}
    return job, cfg, x, y, state, res, commitment, states


def _judge(t: tuple[Any, ...], segment: int, states: Any = None, delta: Any = None) -> Any:
    job, cfg, x, y, state, res, c, own = t
    return judge_segment(
        update_id="u-1",
        node_id="n-1",
        round=0,
        spec=job.model,
        cfg=cfg,
        seed=5,
        commitment=c,
        segment=segment,
        states=states or own,
        global_state=state,
        delta=delta or res.delta,
        x=x,
        y=y,
        tolerance=VerificationSpec().segment_tolerance,
    )


def test_the_referee_replays_every_lora_segment_and_catches_a_base_moved_in_the_committed_states(
    tmp_path: Path,
) -> None:
    """The replay dequantizes as the node did (same module from the spec): a CPU replay of a CPU
    node's segment lands on its committed end exactly. A start state whose frozen weights are not
    the round's (a node that trained the base too and hid it from its adapter-only update) is a
    mismatch, however well the replay from it reproduces."""
    t = _committed_lora_training(tmp_path)
    c, states = t[6], t[7]
    for seg in range(len(c.norms)):
        v = _judge(t, seg)
        assert v.outcome == "reproduced" and v.evidence["distance"] == 0.0, (seg, v.evidence)
    grid = sorted(states)
    doctored = {s: dict(st) for s, st in states.items()}
    doctored[grid[1]]["model.0.bias"] = doctored[grid[1]]["model.0.bias"] + 0.01
    v = _judge(t, 1, states=doctored)
    assert v.outcome == "mismatch" and "changed the frozen base weights" in v.evidence["why"], (
        v.evidence
    )
    whole = {k: torch.zeros_like(s) for k, s in t[4].items()}  # an update that is not the adapters
    assert _judge(t, 0, delta=whole).outcome == "mismatch"


def test_an_adapter_update_is_judged_against_the_trend_of_the_adapters() -> None:
    from gpuflex.hub.policy.distances import trend_alignment

    spec = parse_job_spec(MLP + LORA).model
    then = build_model(spec, 0).state_dict()
    step = {
        k: torch.full_like(then[k], 0.01) for k in ("0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b")
    }
    now = {k: v + step[k] if k in step else v for k, v in then.items()}
    assert trend_alignment(step, now, then)[0] == pytest.approx(
        1.0
    )  # the adapters move with their own trend
    against = {k: v if k.startswith("0.") else -v for k, v in step.items()}  # layer 2 undone
    assert trend_alignment(against, now, then) == pytest.approx((-1.0, "2"))


@pytest.mark.e2e
@pytest.mark.one_store  # no hub at all: the node's workers alone
def test_a_lora_assignment_on_two_ddp_workers_gives_one_process_adapter_update(
    tmp_path: Path,
) -> None:
    """The node's worker group (node/devices, gloo on the CPU) sends the adapters only, as one
    process does, and the same update to rounding."""
    from gpuflex.node.devices import WorkerGroup, parse_devices

    job = parse_job_spec(
        MLP + LORA + 'local_epochs = 2\nbatch_size = 16\noptimizer = "adam"\nlr = 0.01\n'
    )
    spec, cfg = job.model, job.train.train_config()
    xtr, ytr, _, _ = digits_arrays()
    chunks = [
        {
            "x": torch.from_numpy(xtr[i : i + 32].copy()),
            "y": torch.from_numpy(ytr[i : i + 32].copy()),
        }
        for i in range(0, 96, 32)
    ]
    state = build_model(spec, 1).state_dict()
    ref = train_assignment(spec, state, chunks, cfg, 5, device=torch.device("cpu"))
    group = WorkerGroup(
        parse_devices("cpu:2"),
        tmp_path / "work",
        engine="ddp",
        threads=1,
        restarts=0,
        on_event=lambda *_a, **_k: None,
    )
    got = group.train(spec, state, chunks, cfg, seed=5, commit=None)
    assert list(got.delta) == list(ref.delta) == [t.name for t in update_manifest(spec)]
    for k, v in ref.delta.items():
        assert float((got.delta[k] - v).abs().max()) <= 1e-5 * float(v.abs().max()), k


def test_the_node_sizes_a_lora_assignment_by_its_int8_weights_and_the_adapters_it_trains() -> None:
    from gpuflex.node.devices.plan import training_bytes

    job = parse_job_spec(MLP + LORA + 'optimizer = "adam"\n')
    state = build_model(job.model, 0).state_dict()
    trained = {t.name for t in update_manifest(job.model)}
    model, opt = training_bytes(state, job.train.train_config(), trained)
    held = sum(t.numel() * t.element_size() for t in state.values())
    adapters = sum(state[k].numel() for k in trained) * 4
    assert (model, opt) == (held + adapters, 2 * adapters)
    full = parse_job_spec(MLP + '[train]\noptimizer = "adam"\n')
    fm, fo = training_bytes(build_model(full.model, 0).state_dict(), full.train.train_config())
    assert (model + opt) / (fm + fo) < 0.35
