"""The README's job-spec reference and model examples are real, parseable specs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gpuflex.protocol import jobspec
from gpuflex.protocol.modelspec import build_model, param_count

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```toml\n(.*?)```", README.read_text(), flags=re.S)
MODEL_BLOCKS = [b for b in BLOCKS if b.lstrip().startswith("#") and "[model]" in b]
REFERENCE = next(b for b in BLOCKS if "[verification]" in b)


def test_readme_has_examples_for_every_model_kind() -> None:
    kinds = {re.search(r'kind = "(\w+)"', b).group(1) for b in MODEL_BLOCKS}  # type: ignore[union-attr]
    assert kinds == {"mlp", "cnn", "sequential"}


@pytest.mark.parametrize("block", MODEL_BLOCKS, ids=lambda b: re.search(r'kind = "(\w+)"', b).group(1))  # type: ignore[union-attr]
def test_reference_with_each_model_example_parses_and_builds(block: str) -> None:
    reference = REFERENCE.replace("[model]                         # required: one of the three kinds below\n", "")
    spec = jobspec.parse_job_spec(reference + "\n" + block)
    assert spec.name == "digits"
    model = build_model(spec.model, seed=0)
    assert sum(p.numel() for p in model.parameters()) == param_count(spec.model)


def test_reference_defaults_match_the_parser() -> None:
    """Every value the reference shows is the parser's default (the reference is not a wish list)."""
    reference = REFERENCE.replace("[model]                         # required: one of the three kinds below\n", "")
    mlp = next(b for b in MODEL_BLOCKS if 'kind = "mlp"' in b)
    shown = jobspec.parse_job_spec(reference + "\n" + mlp)
    minimal = jobspec.parse_job_spec('[job]\nname = "digits"\n' + mlp)
    assert shown == minimal
