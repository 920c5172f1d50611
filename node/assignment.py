"""The node's own checks on a signed assignment, before a byte is downloaded.

The protocol already checked the signature and every field's type and bounds; these are
the checks only the node can make: is it for this node, in a precision it trains, not a replay, are its times
plausible, does the declared model size fit the model the spec builds, does every chunk's
declared size fit its sample count, does it all fit the cache cap.

A chunk may be one of this node's silos (node-local data, node/silos.py): it passes the same
per-chunk checks, does not count against the cache, and is read from the silo store (its
SHA-256 checked again), never from the cache or the network.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import Assignment
from gpuflex.protocol.modelspec import ModelSpec, manifest, param_count
from gpuflex.protocol.tensors import (
    ITEMSIZE,
    MAX_HEADER_BYTES,
    check_manifest,
    decode_state,
    load_state_file,
)
from torch import Tensor

from .cache import BlobCache
from .errors import AssignmentRejected, TrainError
from .silos import SiloError, SiloStore

MAX_BLOB_BYTES = 8 << 30
MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600.0
CLOCK_SKEW_S = 300.0
HEADER_ALLOWANCE = MAX_HEADER_BYTES + 64  # GFT1 header + alignment on top of raw tensor bytes


def check_assignment(
    a: Assignment, *, node_id: str, now: float, seen: Container[str], cache_cap_bytes: int,
    precisions: Sequence[str] = ("fp32",), local: Container[str] = frozenset(),
) -> ModelSpec:
    """The assignment's model spec when every check passes; AssignmentRejected otherwise.

    ``now`` is the hub's clock as the node estimates it; ``seen`` the assignment ids this
    node already finished (the same one again is a replay); ``precisions`` what this node
    trains in (its compute class): an assignment in another precision is refused; ``local``
    the blob ids of this node's silos (read from its disk: not counted against the cache).
    """
    if a.node_id != node_id:
        raise AssignmentRejected(f"assignment {a.assignment_id} is for {a.node_id}, not this node")
    if a.train.precision not in precisions:
        raise AssignmentRejected(
            f"assignment {a.assignment_id} asks for precision {a.train.precision}; "
            f"this node trains only {', '.join(precisions)}"
        )
    if a.assignment_id in seen:
        raise AssignmentRejected(f"assignment {a.assignment_id} was already handled (replay)")
    if a.deadline <= now:
        raise AssignmentRejected(f"assignment {a.assignment_id} deadline already passed")
    if a.deadline - now > MAX_DEADLINE_AHEAD_S or a.issued_at > now + CLOCK_SKEW_S:
        raise AssignmentRejected(f"assignment {a.assignment_id} has implausible times")
    if a.deadline <= a.issued_at:
        raise AssignmentRejected(f"assignment {a.assignment_id} deadline precedes its issue time")
    try:
        spec = ModelSpec.from_dict(a.model_spec)
        specs = manifest(spec)
        params = param_count(spec)
    except ProtocolError as exc:
        raise AssignmentRejected(f"assignment {a.assignment_id}: model spec refused: {exc}") from exc
    raw = sum(math.prod(t.shape) * int(ITEMSIZE[t.dtype]) for t in specs)
    if not raw <= a.model_size <= raw + HEADER_ALLOWANCE + 64 * len(specs):
        raise AssignmentRejected(
            f"assignment {a.assignment_id}: model_size {a.model_size} does not fit a "
            f"{params}-parameter model ({raw} bytes)"
        )
    if not a.chunks:
        raise AssignmentRejected(f"assignment {a.assignment_id} names no chunks")
    names: set[str] = set()
    row = spec.sample_bytes
    for c in a.chunks:
        if c.sha256 in names:
            raise AssignmentRejected(f"assignment {a.assignment_id} names chunk {c.sha256[:12]}… twice")
        names.add(c.sha256)
        if c.samples < 1 or not c.samples * row <= c.size <= c.samples * row + HEADER_ALLOWANCE:
            raise AssignmentRejected(
                f"assignment {a.assignment_id}: chunk {c.sha256[:12]}… declares {c.size} bytes "
                f"for {c.samples} samples of {row} bytes"
            )
        if c.size > MAX_BLOB_BYTES:
            raise AssignmentRejected(f"chunk {c.sha256[:12]}… is larger than {MAX_BLOB_BYTES} bytes")
    need = a.model_size + sum(c.size for c in a.chunks if c.sha256 not in local)
    if need > cache_cap_bytes:
        raise AssignmentRejected(
            f"assignment {a.assignment_id} needs {need / 1e9:.2f} GB of cache, cap is "
            f"{cache_cap_bytes / 1e9:.2f} GB; raise --max-cache-gb"
        )
    return spec


def load_inputs(
    cache: BlobCache, a: Assignment, spec: ModelSpec, *, silos: SiloStore | None = None,
    local: Container[str] = frozenset(),
) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """The global model and the chunks, read from the cache (disk I/O: call it in a thread).

    A chunk in ``local`` is one of this node's silos: read from ``silos``, its size and SHA-256
    checked on the way. Each must fit what the assignment declares: the model the spec's
    manifest, each chunk its sample count; TrainError otherwise (nothing is trained).
    """
    try:
        global_state = load_state_file(cache.touch(a.model_hash))
        check_manifest(global_state, manifest(spec))
        chunks = []
        for c in a.chunks:
            if c.sha256 in local:
                if silos is None:
                    raise TrainError(f"chunk {c.sha256[:12]}… is a silo, and no silo store was given")
                chunk = decode_state(silos.read_blob(c.sha256, c.size))
            else:
                chunk = load_state_file(cache.touch(c.sha256))
            x = chunk.get("x")
            if x is None or x.shape[0] != c.samples:
                raise TrainError(f"chunk {c.sha256[:12]}… does not hold {c.samples} samples")
            chunks.append(chunk)
    except ProtocolError as exc:
        raise TrainError(f"assignment {a.assignment_id}: inputs refused: {exc}") from exc
    except SiloError as exc:
        raise TrainError(f"assignment {a.assignment_id}: {exc}") from exc
    return global_state, chunks


__all__ = ["CLOCK_SKEW_S", "HEADER_ALLOWANCE", "MAX_BLOB_BYTES", "MAX_DEADLINE_AHEAD_S", "check_assignment", "load_inputs"]
