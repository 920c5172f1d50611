"""The downloaded model file describes itself: its metadata names the model spec, the job, the
round and the hub's key, and the one call of the owner's guide (docs/owner.md) rebuilds the torch
module from the file alone.

A real hub on 127.0.0.1 trains one round with a simulated node; the real CLI downloads the
model in a process, and the guide's snippet runs as written in another.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from gpuflex.protocol import load_safetensors_model, parse_job_spec
from gpuflex.protocol.errors import SpecError
from gpuflex.protocol.modelspec import ModelSpec, build_for_state
from gpuflex.protocol.tensors import decode_state, state_to_safetensors
from safetensors import safe_open

from tests.helpers import job_with_a_round

OWNER_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "owner.md"


def _guide_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", OWNER_GUIDE.read_text(), flags=re.S)
    return next(b for b in blocks if "load_safetensors_model" in b)


async def _run(*argv: str, cwd: Path, env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_downloaded_model_names_its_spec_job_round_and_hub_and_rebuilds_alone(running_hub, tmp_path):
    hub = running_hub
    job_id, spec_path, _ = await job_with_a_round(hub, tmp_path)
    env = dict(os.environ, GPUFLEX_HUB=hub.url, GPUFLEX_TOKEN=hub.owner_token)
    out = await _run(sys.executable, "-m", "gpuflex.hub", "job", "download", job_id, "-o", "model.safetensors",
                     cwd=tmp_path, env=env)
    assert "model version 1" in out, out
    path = tmp_path / "model.safetensors"

    with safe_open(str(path), "pt") as f:  # the safetensors library alone reads it
        meta = f.metadata()
    spec = parse_job_spec(spec_path.read_text()).model
    assert meta["format"] == "gpuflex-model/1" and meta["job_id"] == job_id and meta["round"] == "1", meta
    assert meta["hub_fingerprint"] == hub.fingerprint, meta
    assert ModelSpec.from_dict(json.loads(meta["model_spec"])) == spec

    model = load_safetensors_model(path)
    assert not model.training
    async with aiohttp.ClientSession() as s, s.get(f"{hub.url}/v1/jobs/{job_id}", headers=hub.auth()) as r:
        model_hash = (await r.json())["model_hash"]
    expected = build_for_state(spec, _blob(hub, model_hash))  # the hub's own copy of the model
    x = torch.rand(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), expected.eval()(x))

    # the owner's guide's snippet, as written, in a process of its own next to the file
    printed = await _run(sys.executable, "-c", _guide_snippet(), cwd=tmp_path, env=env)
    assert re.fullmatch(r"tensor\(\[\d\]\)\n", printed), printed


def _blob(hub, sha: str) -> dict[str, torch.Tensor]:
    from gpuflex.hub.server.appkeys import BLOBS

    return decode_state(hub.app[BLOBS].read(sha))


def test_a_file_without_the_spec_or_with_other_tensors_is_refused_in_one_line(tmp_path):
    from gpuflex.protocol.modelfile import model_file_metadata
    from gpuflex.protocol.modelspec import build_model

    spec = ModelSpec.from_dict({"kind": "mlp", "input": 4, "hidden": [3], "outputs": 2})
    state = build_model(spec, seed=0).state_dict()
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes(state_to_safetensors(state))
    with pytest.raises(SpecError, match="no GPUFlex model spec in the file's metadata"):
        load_safetensors_model(bare)
    other = ModelSpec.from_dict({"kind": "mlp", "input": 4, "hidden": [5], "outputs": 2})
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(state_to_safetensors(state, model_file_metadata(other, job_id="j-1", round_=0,
                                                                      hub_fingerprint="gf1-x")))
    with pytest.raises(SpecError, match="the tensors do not fit the spec") as exc:
        load_safetensors_model(wrong)
    assert "\n" not in str(exc.value)
    good = tmp_path / "good.safetensors"
    good.write_bytes(state_to_safetensors(state, model_file_metadata(spec, job_id="j-1", round_=0,
                                                                     hub_fingerprint="gf1-x")))
    rebuilt = load_safetensors_model(good)
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in state.items())
