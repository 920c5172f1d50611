"""Real text on every machine without a download: the Python standard library's own source
files, read from disk, for language-model tests and benches."""

from __future__ import annotations

import sysconfig
from pathlib import Path

#: modules of the standard library whose source is plain prose-heavy Python (docstrings)
FILES = (
    "textwrap.py",
    "difflib.py",
    "argparse.py",
    "inspect.py",
    "typing.py",
    "pathlib.py",
    "dataclasses.py",
)


def stdlib_text(n_bytes: int) -> bytes:
    """The first ``n_bytes`` of the standard library's sources in FILES, read in order (cut at a
    character boundary so it stays UTF-8)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for name in FILES:
        path = root / name
        if path.is_dir():  # pathlib is a package from Python 3.13
            path = path / "__init__.py"
        if path.is_file():
            out += path.read_bytes()
        if len(out) >= n_bytes:
            break
    if len(out) < n_bytes:
        raise RuntimeError(
            f"the standard library at {root} holds {len(out)} bytes of {FILES}, not {n_bytes}"
        )
    return out[:n_bytes].decode("utf-8", errors="ignore").encode("utf-8")


def transformer_pipeline_spec(
    name: str, *, batch: int, micro: int, steps: int, every: int, stages: int = 4,
    schedule: str = "1f1b", context: int = 32, width: int = 128, seed: int = 0, tail: str = "",
) -> str:
    """The job spec the pipelined transformer runs share (the e2e test, bench/pipeline_recovery.py,
    bench/pipeline_shaped.py): a byte-level transformer of 4 blocks over ``stdlib_text``, cut into
    ``stages``; ``tail``: more ``[pipeline]`` lines (verify_rate, boundary)."""
    return f"""[job]
name = "{name}"

[model]
kind = "transformer"
vocab = 256
context = {context}
layers = 4
width = {width}
heads = 4
dropout = 0.0

[train]
batch_size = {batch}
optimizer = "sgd"
lr = 0.05
momentum = 0.9
seed = {seed}

[data]
chunk_size = 256
validation_fraction = 0.0

[pipeline]
stages = {stages}
micro_batches = {micro}
schedule = "{schedule}"
steps = {steps}
checkpoint_every = {every}
{tail}"""
