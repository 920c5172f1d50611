"""What the hub decides for a job's data when the owner's spec leaves it open.

- ``validation_fraction`` unset and no validation file: the hub holds out
  ``DEFAULT_VALIDATION_FRACTION`` of the training set, so every round reports loss and accuracy;
  a dataset too small to give ``MIN_VALIDATION_SAMPLES`` that way is left whole. An explicit
  ``validation_fraction = 0`` turns the hold-out off.
- ``chunk_size`` unset: chunks are sized from the training set and the nodes online, so that a
  round has at least ``MIN_CHUNKS`` chunks and one for every node online (a shard is at least one
  chunk: fewer chunks than nodes leaves nodes idle), within ``MIN_CHUNK_SIZE`` and
  ``DEFAULT_CHUNK_SIZE`` rows.

What was decided is written into the stored spec's ``[data]`` table with a comment saying why
(:func:`record_in_spec`), so the job's spec says how it was cut. Pure functions.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from typing import Final

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.jobspec import DataSpec, JobSpec, parse_job_spec

DEFAULT_VALIDATION_FRACTION: Final = 0.1
MIN_VALIDATION_SAMPLES: Final = 10
DEFAULT_CHUNK_SIZE: Final = 64
MIN_CHUNK_SIZE: Final = 8
MIN_CHUNKS: Final = 16

_DATA_HEADER = re.compile(r"^[ \t]*\[[ \t]*data[ \t]*\][ \t]*(#.*)?$", re.M)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One value the hub chose for the spec's [data] table, and why (a TOML comment)."""

    key: str
    value: float | int
    why: str


def validation_default(spec: DataSpec, samples: int, val_given: bool) -> Decision | None:
    """The hold-out for a job whose spec leaves ``validation_fraction`` unset (None when it is
    set or a validation file was given)."""
    if spec.validation_fraction is not None or val_given:
        return None
    if samples * DEFAULT_VALIDATION_FRACTION < MIN_VALIDATION_SAMPLES:
        return Decision("validation_fraction", 0.0,
                        f"set by the hub: {samples} rows are too few for a {DEFAULT_VALIDATION_FRACTION:.0%}"
                        f" hold-out of at least {MIN_VALIDATION_SAMPLES}, and no val file was given")
    return Decision("validation_fraction", DEFAULT_VALIDATION_FRACTION,
                    f"set by the hub: no val file was given ({DEFAULT_VALIDATION_FRACTION:.0%} of the rows"
                    " are held out; validation_fraction = 0 turns it off)")


def chunk_size_default(spec: DataSpec, samples: int, nodes_online: int) -> Decision | None:
    """The chunk size for a job whose spec leaves ``chunk_size`` unset (None when it is set)."""
    if spec.chunk_size is not None:
        return None
    want = max(MIN_CHUNKS, nodes_online)
    size = min(DEFAULT_CHUNK_SIZE, max(MIN_CHUNK_SIZE, math.ceil(samples / want)))
    return Decision("chunk_size", size,
                    f"set by the hub: {samples} training rows for at least {want} chunks"
                    f" ({nodes_online} nodes online), {MIN_CHUNK_SIZE}..{DEFAULT_CHUNK_SIZE} rows each")


def record_in_spec(text: str, spec: JobSpec, decisions: list[Decision]) -> str:
    """``text`` with ``decisions`` written into its [data] table (a new one at the end when it has
    none), each with its reason as a comment; ``text`` unchanged when there is nothing to record or
    the spec writes [data] in a form this does not edit (an inline table, dotted keys). The result
    is checked: it parses to ``spec`` with the decided values."""
    if not decisions:
        return text
    lines = "".join(f"{d.key} = {d.value!r}  # {d.why}\n" for d in decisions)
    match = list(_DATA_HEADER.finditer(text))
    if len(match) == 1:
        at = match[0].end()
        new = text[:at] + "\n" + lines + text[at + 1 :] if text[at : at + 1] == "\n" else text[:at] + "\n" + lines
    elif not match and "data" not in _table_names(text):
        new = text.rstrip("\n") + "\n\n[data]\n" + lines
    else:
        return text
    return new if _parses_to(new, apply_decisions(spec, decisions)) else text


def apply_decisions(spec: JobSpec, decisions: list[Decision]) -> JobSpec:
    """``spec`` with the decided values in its [data]."""
    return dataclasses.replace(spec, data=dataclasses.replace(spec.data, **{d.key: d.value for d in decisions}))


def _table_names(text: str) -> set[str]:
    try:
        return set(tomllib.loads(text))
    except tomllib.TOMLDecodeError:
        return {"data"}  # (a spec that parsed does not get here; refuse to edit it all the same)


def _parses_to(text: str, spec: JobSpec) -> bool:
    try:
        return parse_job_spec(text) == spec
    except ProtocolError:
        return False
