"""How the tensors that cross a pipeline cut travel: the job's ``[pipeline] boundary`` encoding.

An activation goes forward across a cut and its gradient comes back; both take the same encoded
form, one GFT1 tensor whose dtype and shape :func:`encoded_crossing` gives from the raw tensor's.
The hub's relay checks that form, the receiving stage checks it again and then decodes it:

- ``fp32``: the tensor as the stage computed it (no encoding: bit-identical training);
- ``fp16``, ``bf16``: cast to half precision (fp16 overflows beyond 65504, bf16 does not);
- ``int8``: each row (the last dimension) rounded to 127 levels of its largest magnitude, the
  row's float32 scale appended as 4 more int8 values (its bytes, little-endian): a row of ``w``
  values becomes ``w + 4`` bytes;
- ``subspace``: each row projected onto a fixed orthonormal basis of ``rank`` directions
  (``subspace_basis``, keyed by the job's seed and the cut, so both sides build the same
  one), then rounded like int8 but to 4 bits (7 levels either side of zero, two values a byte)
  with the row's scale: ``ceil(rank / 2) + 4`` bytes a row. The gradient goes back through the same
  basis, which is its exact chain rule: the model trained is the model with a fixed linear
  bottleneck at each cut (docs/pipeline.md says what that means for the assembled model);
- ``subspace_log``: the subspace code with its row scale in one byte instead of four, a power of
  2**(1/4) rounded up so no value is clipped (2**-47.75 to 2**15.75; a larger row saturates):
  ``ceil(rank / 2) + 1`` bytes a row, so three more bytes of each row go to six more directions;
  and one basis for every cut of the same width (``shared_basis``, keyed by the job's seed), so
  the residual stream keeps the same directions from cut to cut.
- ``subspace_scaled``: subspace_log's wire (the same basis, values and scale byte), decoded
  ``width / rank`` times larger. A random basis's projection is on average ``rank / width``
  times the identity, so subspace_log hands the next stage a residual stream shrunk by that
  much against what the stage adds to it; scaled back, the projection is on average the
  identity. The gradient comes back through the same scaled map, which is its exact chain rule:
  the model trained has the fixed linear map ``width / rank`` times the projection at each cut.

This module is pure (no torch): the job spec and the hub's relay plan use it; the torch codec,
encoder beside decoder, is protocol/boundarycodec.py's ``BoundaryCode``.
"""

from __future__ import annotations

from typing import Final

from .errors import SpecError

BOUNDARIES: Final = (
    "fp32", "fp16", "bf16", "int8", "subspace", "subspace_log", "subspace_scaled"
)  # fmt: skip
#: the encodings that project onto a subspace, and so take a ``boundary_rank``
RANKED: Final = ("subspace", "subspace_log", "subspace_scaled")
#: the subspace encodings with subspace_log's wire: one basis for every cut, a scale byte a row
LOG_SCALED: Final = ("subspace_log", "subspace_scaled")
#: the bytes of an int8 row's float32 scale, appended to the row
SCALE_BYTES: Final = 4
#: the bits of each of the subspace code's values (two a byte)
SUBSPACE_BITS: Final = 4
#: the bytes of a subspace_log row's scale: 2**((byte - LOG_SCALE_ZERO) / LOG_SCALE_STEPS), the
#: byte 255 left for a row no scale fits (NaN or infinity), which the receiver refuses
LOG_SCALE_BYTES: Final = 1
LOG_SCALE_STEPS: Final = 4
LOG_SCALE_ZERO: Final = 191
#: the dtype each cast encoding sends
CASTS: Final = {"fp16": "float16", "bf16": "bfloat16"}
_FLOATS: Final = ("float16", "bfloat16", "float32", "float64")


def check_boundary(boundary: str, rank: int, width: int | None = None) -> None:
    """SpecError (one line) unless ``boundary`` is known and ``rank`` fits it: at least 1 and
    below ``width`` (the cut's last dimension, when known) for a subspace code, 0 for every other."""
    if boundary not in BOUNDARIES:
        raise SpecError(
            f"pipeline.boundary: expected one of {', '.join(BOUNDARIES)}, got {boundary!r:.40}"
        )
    if boundary not in RANKED:
        if rank != 0:
            raise SpecError(
                f"pipeline.boundary_rank: only the subspace boundary has a rank "
                f"({', '.join(RANKED)}); leave it out for {boundary!r}, got {rank}"
            )
        return
    if rank < 1:
        raise SpecError(
            f"pipeline.boundary_rank: the {boundary} boundary needs a rank of at least 1"
        )
    if width is not None and rank >= width:
        raise SpecError(
            f"pipeline.boundary_rank: {rank} does not compress a cut {width} wide; "
            f"choose a rank below {width}"
        )


def encoded_crossing(
    shape: tuple[int, ...], dtype: str, boundary: str, rank: int
) -> tuple[str, tuple[int, ...]]:
    """The (dtype name, shape) of the encoded form of a ``dtype`` tensor of ``shape`` crossing a
    cut: what the relay and the receiving stage check. SpecError when the setting does not fit
    the tensor (an unknown encoding, a rank not below its last dimension, a non-float tensor)."""
    width = shape[-1] if shape else None
    check_boundary(boundary, rank, width)
    if boundary == "fp32":
        return dtype, tuple(shape)
    if dtype not in _FLOATS or width is None:
        raise SpecError(
            f"pipeline.boundary: {boundary!r} encodes a floating tensor of at least one "
            f"dimension, not {dtype} {list(shape)}"
        )
    if boundary in CASTS:
        return CASTS[boundary], tuple(shape)
    if boundary == "int8":
        return "int8", (*shape[:-1], width + SCALE_BYTES)
    kept = (rank * SUBSPACE_BITS + 7) // 8
    scale = SCALE_BYTES if boundary == "subspace" else LOG_SCALE_BYTES
    return "int8", (*shape[:-1], kept + scale)


__all__ = [
    "BOUNDARIES",
    "CASTS",
    "LOG_SCALED",
    "LOG_SCALE_BYTES",
    "LOG_SCALE_STEPS",
    "LOG_SCALE_ZERO",
    "RANKED",
    "SCALE_BYTES",
    "SUBSPACE_BITS",
    "check_boundary",
    "encoded_crossing",
]
