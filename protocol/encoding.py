"""Update encodings: how a node's update travels, smaller than fp32.

A job picks one (``[communication] update``); the hub signs it into every assignment, so both
sides know the wire layout before a byte moves. An encoded update is an ordinary GFT1 blob
(protocol/tensors.py: no pickle, header checked before data, tensors decoded as views), only
with other tensors in it. For each *floating* tensor ``name`` of the model:

========  ==========================================================================
fp32      ``name`` float32, as the model (the identity: nothing is lost)
fp16      ``name`` float16, same shape (round to nearest even)
bf16      ``name`` bfloat16, same shape
int8      ``name`` int8, same shape: codes in [-127, 127]; and ``name:scale`` float32 of
          ``ceil(numel / INT8_BLOCK)`` values: each block of INT8_BLOCK consecutive
          elements (row-major) is ``code * scale``, scale = the block's max |x| / 127
topk      (no per-tensor entry) ``topk:index`` int32 and ``topk:value`` float32, both of
          ``kept(N)`` entries, N = every floating element of the model laid end to end in
          manifest order: the positions of the largest |x| over the whole model, strictly
          increasing, and their values; every other element is zero. One budget for the whole
          model (not one per tensor) spends it where the update is, and a small model's
          many small tensors cost no per-tensor header
sign      (no per-tensor entry) ``sign:bits`` uint8 of ``ceil(N / 8)`` bytes, N as for topk:
          one bit per element (bit ``i % 8`` of byte ``i // 8``, 1 = not negative), the bits
          past N zero; and ``sign:scale`` float32: each tensor's blocks of SIGN_BLOCK
          elements in turn (``ceil(numel / SIGN_BLOCK)`` per tensor, a tensor's last block
          may be short), each block sent as ``±scale``, scale = the block's mean |x| (the
          scale that minimises a sign's squared error). 1 bit plus 1/8 bit of scale per
          element, about 1/28 of fp32, and two header entries for the whole model. Scaled
          sign with error feedback is EF-signSGD (Karimireddy et al. 2019); unlike topk it
          moves every element every round
========  ==========================================================================

Tensors that are not floating (a BatchNorm's step counter) travel as they are. Every encoding
is a deterministic function of its input on a CPU, so the hub can re-encode a state it
replays and compare codes. The one reduction that adds floats, sign's block mean, sums in
float64 and rounds to float32, so two builds that add in another order agree to the last bit
almost always; ``same_code`` allows such a scale one part in 10^6 (its bits must be equal).

**Error feedback** (``error_feedback = true``): what the encoding lost this round,
``x - decode(encode(x))``, is kept by the node and added to its next update of the same job
(Seide et al. 2014; Deep Gradient Compression; PowerSGD). Nothing is lost in the long run,
only delayed. The residual is the node's own state (node/feedback.py keeps it on disk), so
two replicas of one shard carry different residuals: their decoded updates differ by about
one int8 step, or for topk by most of what the update holds. ``[communication] tolerance``
allows for it (``DEFAULT_TOLERANCE``); the referee, which re-encodes with the residual the
node committed in its last checkpoint, is the exact check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .errors import TensorError

if TYPE_CHECKING:  # torch loads where a tensor is touched: specs parse without it (test_cli_startup)
    import torch
    from torch import Tensor

    from .tensors import Manifest

ENCODINGS: Final = ("fp32", "fp16", "bf16", "int8", "topk", "sign")
FLOATING: Final = frozenset({"float32", "float16", "bfloat16", "float64"})
INT8_BLOCK: Final = 2048
INT8_MAX: Final = 127
SIGN_BLOCK: Final = 256
#: how far a sign scale re-encoded on another build may be from the node's (relative): the
#: float64 block sum rounds to float32 the same way unless it sits on a rounding boundary
SIGN_SCALE_RTOL: Final = 1e-6
SCALE: Final = ":scale"
TOPK_INDEX: Final = "topk:index"
TOPK_VALUE: Final = "topk:value"
SIGN_BITS: Final = "sign:bits"
SIGN_SCALE: Final = "sign:scale"
MAX_TOPK_NUMEL: Final = (1 << 31) - 1  # int32 positions
HALF: Final = {"fp16": "float16", "bf16": "bfloat16"}

#: The relative distance the encoding may add between two honest replicas, per encoding and
#: error feedback, when the job does not set ``[communication] tolerance``. Without feedback,
#: same-class replicas encode to the same codes (distance 0, measured), so the allowance only
#: covers how a code flip magnifies the strict tolerance's 1e-4 of drift (about
#: sqrt(1e-4 x the encoding's relative step)). With feedback, each replica adds its own residual:
#: the allowance is about twice what bench/bandwidth.py measures between honest replicas
#: (docs/encodings.md).
DEFAULT_TOLERANCE: Final[dict[tuple[str, bool], float]] = {
    ("fp32", False): 0.0, ("fp32", True): 0.0,
    ("fp16", False): 3e-4, ("fp16", True): 1e-3,
    ("bf16", False): 1e-3, ("bf16", True): 6e-3,
    ("int8", False): 3e-3, ("int8", True): 4e-2,
    ("topk", False): 1e-2, ("topk", True): 1.5,
    ("sign", False): 5e-2, ("sign", True): 1.5,
}


@dataclass(frozen=True)
class Encoded:
    """An encoded update: the tensors to send, and the residual error feedback carries on."""

    wire: dict[str, Tensor]
    residual: dict[str, Tensor] | None


@dataclass(frozen=True)
class UpdateEncoding:
    """One job's update encoding (``[communication]``)."""

    kind: str = "fp32"
    topk_fraction: float = 0.01
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ENCODINGS:
            raise TensorError(f"update encoding {self.kind!r:.30} is unknown; one of {', '.join(ENCODINGS)}")
        if not (math.isfinite(self.topk_fraction) and 0.0 < self.topk_fraction <= 1.0):
            raise TensorError(f"topk_fraction must be in (0, 1], got {self.topk_fraction!r:.30}")

    @property
    def identity(self) -> bool:
        """fp32 without feedback: the update travels as the model's own tensors."""
        return self.kind == "fp32"

    def kept(self, numel: int) -> int:
        """How many of ``numel`` elements topk keeps: ceil(fraction x numel), at least 1."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.topk_fraction * numel)))

    # ------------------------------------------------------------------ layout

    def wire_manifest(self, model: Manifest) -> Manifest:
        """The tensors an update of a model with manifest ``model`` carries in this encoding."""
        from .tensors import TensorSpec

        if self.identity:
            return model
        out: list[TensorSpec] = []
        total = scales = 0
        for spec in model:
            if spec.dtype not in FLOATING:
                out.append(spec)
                continue
            numel = math.prod(spec.shape)
            total += numel
            if self.kind in HALF:
                out.append(TensorSpec(spec.name, HALF[self.kind], spec.shape))
            elif self.kind == "int8":
                out.append(TensorSpec(spec.name, "int8", spec.shape))
                out.append(TensorSpec(spec.name + SCALE, "float32", (_blocks(numel),)))
            scales += _blocks(numel, SIGN_BLOCK)
        if self.kind == "sign":
            out += [TensorSpec(SIGN_BITS, "uint8", (-(-total // 8),)), TensorSpec(SIGN_SCALE, "float32", (scales,))]
        if self.kind == "topk":
            if total > MAX_TOPK_NUMEL:
                raise TensorError(f"{total} floating elements is too many for topk's int32 positions")
            k = self.kept(total)
            out += [TensorSpec(TOPK_INDEX, "int32", (k,)), TensorSpec(TOPK_VALUE, "float32", (k,))]
        names = [s.name for s in out]
        if len(set(names)) != len(names):
            clash = next(n for n in names if names.count(n) > 1)
            raise TensorError(f"tensor {clash!r}: the model already has a tensor of this name; "
                              f"update = {self.kind!r} cannot encode it")
        return tuple(out)

    # ------------------------------------------------------------------ encode

    def encode(self, delta: Mapping[str, Tensor], residual: Mapping[str, Tensor] | None = None) -> Encoded:
        """Encode a dense update (CPU tensors) given in the model's order (its state dict's, the
        manifest's). With error feedback, ``residual`` (what earlier rounds lost; None = nothing
        yet) is added first, and the new residual is returned."""
        import torch

        if self.identity:
            return Encoded(dict(delta), None)
        feedback = self.error_feedback
        wire: dict[str, Tensor] = {}  # in the model's order, topk's two tensors last (wire_manifest)
        xs: dict[str, Tensor] = {}
        for name, t in delta.items():
            if not t.is_floating_point():
                wire[name] = t
                continue
            x = t.detach().to("cpu", torch.float32)
            if feedback and residual is not None and name in residual:
                r = residual[name]
                if r.shape != t.shape:
                    raise TensorError(f"tensor {name!r}: residual of shape {list(r.shape)}, update {list(t.shape)}")
                x = x + r
            xs[name] = x
            if self.kind not in ("topk", "sign"):
                wire.update(self._encode_one(name, x))
        if self.kind == "sign":
            parts = [x.reshape(-1) for x in xs.values()]
            flat = torch.cat(parts) if parts else torch.zeros(0)
            wire[SIGN_BITS] = _pack_bits(flat >= 0)
            wire[SIGN_SCALE] = torch.cat([_block_mean_abs(p) for p in parts]) if parts else torch.zeros(0)
        if self.kind == "topk":
            flat = torch.cat([x.reshape(-1) for x in xs.values()]) if xs else torch.zeros(0)
            idx = _top_positions(flat, self.kept(flat.numel()))
            wire[TOPK_INDEX], wire[TOPK_VALUE] = idx.to(torch.int32), flat[idx].clone()
        if not feedback:
            return Encoded(wire, None)
        sent = self._decode_floating(wire, [(n, tuple(x.shape), torch.float32) for n, x in xs.items()])
        return Encoded(wire, {n: x - sent[n] for n, x in xs.items()})

    def _encode_one(self, name: str, x: Tensor) -> dict[str, Tensor]:
        import torch

        if self.kind in HALF:
            half = x.to(getattr(torch, HALF[self.kind]))
            if not bool(torch.isfinite(half).all()):
                raise TensorError(f"tensor {name!r}: a value is beyond {self.kind}'s range; use bf16 or int8")
            return {name: half}
        flat = x.reshape(-1)
        scales = _block_absmax(flat) / INT8_MAX
        step = _expand(scales, flat.numel())
        codes = torch.where(step > 0, flat / torch.where(step > 0, step, 1.0), 0.0)
        q = codes.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return {name: q.view(x.shape), name + SCALE: scales}

    # ------------------------------------------------------------------ decode

    def decode(self, wire: Mapping[str, Tensor], model: Manifest) -> dict[str, Tensor]:
        """The dense update (the model's names, shapes and dtypes) from an encoded one whose
        layout already matched ``wire_manifest(model)``. fp32 returns the views themselves.
        TensorError on values no encoder makes (a non-finite or negative scale, topk
        positions out of order or out of range, a non-finite value)."""
        if self.identity:
            return dict(wire)
        self.check(wire, model)
        floating = [(s.name, s.shape, _torch_dtype(s.dtype)) for s in model if s.dtype in FLOATING]
        out = self._decode_floating(wire, floating)
        return {s.name: out[s.name] if s.dtype in FLOATING else wire[s.name] for s in model}

    def check(self, wire: Mapping[str, Tensor], model: Manifest) -> None:
        """TensorError on values no encoder makes, without decoding (the hub's upload check; the
        layout must already match ``wire_manifest(model)``)."""
        import torch

        if self.identity:
            return
        floating = [s for s in model if s.dtype in FLOATING]
        if self.kind == "topk":
            idx, val = wire[TOPK_INDEX], wire[TOPK_VALUE]
            total = sum(math.prod(s.shape) for s in floating)
            if idx.numel():
                i64 = idx.to(torch.int64)
                if int(i64[0]) < 0 or int(i64[-1]) >= total or (idx.numel() > 1 and not bool((i64[1:] > i64[:-1]).all())):
                    raise TensorError(f"tensor {TOPK_INDEX!r}: positions must rise strictly within [0, {total})")
                if not bool(torch.isfinite(val).all()):
                    raise TensorError(f"tensor {TOPK_VALUE!r} contains NaN or infinite values")
            return
        if self.kind == "sign":
            bits, sc = wire[SIGN_BITS], wire[SIGN_SCALE]
            if sc.numel() and not bool((torch.isfinite(sc) & (sc >= 0)).all()):
                raise TensorError(f"tensor {SIGN_SCALE!r}: scales must be finite and not negative")
            total = sum(math.prod(s.shape) for s in floating)
            if total % 8 and int(bits[-1]) >> (total % 8):
                raise TensorError(f"tensor {SIGN_BITS!r}: the bits past the model's {total} elements must be zero")
            return
        for spec in floating:
            t = wire[spec.name]
            if self.kind in HALF:
                if not bool(torch.isfinite(t).all()):
                    raise TensorError(f"tensor {spec.name!r} contains NaN or infinite values")
                continue
            s = wire[spec.name + SCALE]
            if s.numel() and not bool((torch.isfinite(s * INT8_MAX) & (s >= 0)).all()):
                raise TensorError(f"tensor {spec.name + SCALE!r}: scales must be finite and not negative")
            if bool((t == -128).any()):
                raise TensorError(f"tensor {spec.name!r}: int8 code -128 is outside [-127, 127]")

    def residual_fits(self, previous: Mapping[str, Tensor], residual: Mapping[str, Tensor],
                      model: Manifest) -> bool:
        """Whether ``residual`` is what error feedback leaves after encoding an update as
        ``previous`` (an upload of this encoding whose layout matched ``wire_manifest(model)``):
        x = decode(previous) + residual must encode to ``previous`` again. The node's residual
        is ``x - decode(encode(x))`` in float32, and adding it back gives x exactly for fp16,
        bf16, int8 and topk (the subtraction is exact: Sterbenz), so their codes must be equal.
        For sign, x and its block's ±scale may differ in magnitude, so x comes back within a
        rounding of the scale: a bit may differ where x is within 2^-20 of its block's scale
        of zero, and a scale by 1e-5. A residual of zeros always fits (a node that lost its
        file starts over). What this bounds: a node can put into the residual it commits only
        what the encoding's own rounding could have left there, not an arbitrary vector."""
        import torch

        floating = [(s.name, s.shape, _torch_dtype(s.dtype)) for s in model if s.dtype in FLOATING]
        names = {n for n, _, _ in floating}
        if set(residual) - names or any(tuple(residual[n].shape) != tuple(shape)
                                        for n, shape, _ in floating if n in residual):
            return False
        if all(not bool(r.any()) for r in residual.values()):
            return True
        if self.identity:
            return False  # fp32 loses nothing: its residual is zero
        try:
            self.check(previous, model)
        except TensorError:
            return False
        dense = self._decode_floating(previous, [(n, shape, torch.float32) for n, shape, _ in floating])
        x = {n: (dense[n] + residual[n].to(torch.float32)) if n in residual else dense[n] for n, _, _ in floating}
        if not all(bool(torch.isfinite(t).all()) for t in x.values()):
            return False
        bare = UpdateEncoding(self.kind, self.topk_fraction, error_feedback=False)
        try:
            again = bare.encode(x).wire
        except TensorError:
            return False
        if self.kind != "sign":
            return all(torch.equal(again[k], previous[k]) for k in again)
        scales = previous[SIGN_SCALE]
        if not bool(torch.isclose(again[SIGN_SCALE], scales, rtol=1e-5, atol=0.0).all()):
            return False
        total = sum(t.numel() for t in x.values())
        differ = _unpack_bits(again[SIGN_BITS], total) != _unpack_bits(previous[SIGN_BITS], total)
        if not bool(differ.any()):
            return True
        flat = torch.cat([t.reshape(-1) for t in x.values()])
        near = torch.cat([dense[n].reshape(-1).abs() for n, _, _ in floating])  # each element's scale
        return bool((flat[differ].abs() <= near[differ] * 2.0**-20).all())

    def same_code(self, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
        """Whether two encoded updates are the same code: every tensor equal, except that a sign
        scale may differ by SIGN_SCALE_RTOL (a float sum rounded on another build)."""
        import torch

        if set(a) != set(b):
            return False
        for k, x in a.items():
            y = b[k]
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if k == SIGN_SCALE:
                if not bool(torch.isclose(x, y, rtol=SIGN_SCALE_RTOL, atol=0.0).all()):
                    return False
            elif not torch.equal(x, y):
                return False
        return True

    def _decode_floating(self, wire: Mapping[str, Tensor],
                         floating: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, Tensor]:
        """The floating tensors, dense, from checked wire tensors."""
        import torch

        out: dict[str, Tensor] = {}
        if self.kind == "topk":
            total = sum(math.prod(shape) for _, shape, _ in floating)
            flat = torch.zeros(total, dtype=torch.float32)
            idx = wire[TOPK_INDEX]
            if idx.numel():
                flat[idx.to(torch.int64)] = wire[TOPK_VALUE]
            at = 0
            for name, shape, dtype in floating:
                n = math.prod(shape)
                out[name] = flat[at:at + n].view(shape).to(dtype)
                at += n
            return out
        if self.kind == "sign":
            total = sum(math.prod(shape) for _, shape, _ in floating)
            signs = _unpack_bits(wire[SIGN_BITS], total).to(torch.float32).mul_(2.0).sub_(1.0)
            scales = wire[SIGN_SCALE]
            at = block = 0
            for name, shape, dtype in floating:
                n, nb = math.prod(shape), _blocks(math.prod(shape), SIGN_BLOCK)
                dense = signs[at:at + n] * _expand(scales[block:block + nb], n, SIGN_BLOCK)
                out[name] = dense.to(dtype).reshape(shape)
                at, block = at + n, block + nb
            return out
        for name, shape, dtype in floating:
            if self.kind in HALF:
                out[name] = wire[name].to(dtype).reshape(shape)
            else:
                numel = math.prod(shape)
                dense = wire[name].reshape(-1).to(torch.float32) * _expand(wire[name + SCALE], numel)
                out[name] = dense.to(dtype).reshape(shape)
        return out


def _top_positions(flat: Tensor, k: int) -> Tensor:
    """The positions of the ``k`` largest |x|, ascending; among equal magnitudes at the cut the
    lowest positions win. ``torch.topk`` alone may break such ties differently from one build to
    another (a model with frozen, all-zero updates is all ties), and the referee re-encodes
    with its own build."""
    import torch

    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    if flat.numel() >= _SELECT_MIN_NUMEL:
        found = _top_positions_sampled(flat, k, _SELECT_SAMPLES)
        if found is not None:
            return found
    mag = flat.abs()
    cut = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > cut).reshape(-1)
    at = torch.nonzero(mag == cut).reshape(-1)[: k - above.numel()]
    return torch.cat([above, at]).sort().values


#: from this many elements up, ``_top_positions`` selects through a sampled threshold
_SELECT_MIN_NUMEL: Final = 1 << 16
_SELECT_SAMPLES: Final = 1 << 16


def _top_positions_sampled(flat: Tensor, k: int, samples: int) -> Tensor | None:
    """``_top_positions`` (0 < k <= numel) without a top-k over the whole input, the same index
    set; None where it cannot tell (a NaN, or a threshold that kept fewer than k: the caller
    selects the slow way). A threshold ``t`` read off an evenly strided sample keeps a little
    over k candidates, ``|x| > t``; when at least k pass, the k-th largest |x| (the cut) is the
    k-th largest among them, and every element above or at the cut is one of them. When fewer
    than k pass but enough equal ``t``, the cut is ``t`` itself (ties: an all-zero update)."""
    import torch

    n = flat.numel()
    if bool(torch.isnan(flat.max())):  # max propagates NaN: the slow way orders NaN as torch.topk does
        return None
    stride = max(1, n // max(1, samples))
    sample = flat[::stride].abs()
    s = sample.numel()
    expected = k * s / n
    rank = min(s, math.ceil(expected + 4.0 * math.sqrt(expected) + 4.0))  # the sample's rank-th largest
    t = torch.kthvalue(sample, s - rank + 1).values
    cand = torch.nonzero(torch.gt(flat, t).logical_or_(torch.lt(flat, -t))).reshape(-1)  # |x| > t, ascending
    c = cand.numel()
    if c >= k:
        mag = flat[cand].abs()
        cut = torch.kthvalue(mag, c - k + 1).values
        keep = mag > cut
        tied = mag == cut
        need = k - int(keep.sum())
        return cand[keep.logical_or_(tied.logical_and_(tied.cumsum(0) <= need))]
    ties: list[Tensor] = []  # the lowest k - c positions where |x| == t, a slice at a time
    need, start, step = k - c, 0, max(k, 1 << 20)
    while need > 0 and start < n:
        part = flat[start:start + step]
        at = torch.nonzero(torch.eq(part, t).logical_or_(torch.eq(part, -t))).reshape(-1)[:need]
        ties.append(at + start)
        need -= at.numel()
        start += step
    if need > 0:
        return None
    return torch.cat([cand, *ties]).sort().values


def _blocks(numel: int, block: int = INT8_BLOCK) -> int:
    return -(-numel // block)


def _pack_bits(bits: Tensor) -> Tensor:
    """Booleans as bytes, 8 to a byte, element i in bit i % 8 of byte i // 8; the last byte's
    unused bits zero."""
    import torch

    n = bits.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
    padded[:n] = bits.reshape(-1)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: Tensor, numel: int) -> Tensor:
    """The first ``numel`` bits of ``_pack_bits``'s bytes, as uint8 0/1."""
    import torch

    shifts = torch.arange(8, dtype=torch.uint8)
    return packed.reshape(-1, 1).bitwise_right_shift(shifts).bitwise_and_(1).reshape(-1)[:numel]


def _block_mean_abs(flat: Tensor) -> Tensor:
    """Each SIGN_BLOCK block's mean |x| (the last block may be short), summed in float64."""
    import torch

    n = flat.numel()
    full = n // SIGN_BLOCK * SIGN_BLOCK
    parts = []
    if full:
        parts.append(flat[:full].view(-1, SIGN_BLOCK).abs().sum(dim=1, dtype=torch.float64) / SIGN_BLOCK)
    if n > full:
        parts.append((flat[full:].abs().sum(dtype=torch.float64) / (n - full)).reshape(1))
    return torch.cat(parts).to(torch.float32) if parts else torch.zeros(0)


def _block_absmax(flat: Tensor) -> Tensor:
    import torch

    n = flat.numel()
    full = n // INT8_BLOCK * INT8_BLOCK
    parts = []
    if full:
        parts.append(flat[:full].view(-1, INT8_BLOCK).abs().amax(dim=1))
    if n > full:
        parts.append(flat[full:].abs().amax().reshape(1))
    return torch.cat(parts) if parts else torch.zeros(0)


def _expand(scales: Tensor, numel: int, block: int = INT8_BLOCK) -> Tensor:
    """Per-block scales as one value per element (the last block may be short)."""
    return scales.repeat_interleave(block)[:numel] if numel else scales.new_zeros(0)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float64": torch.float64}[name]


def default_tolerance(kind: str, error_feedback: bool) -> float:
    """The replica allowance a job gets for its encoding when it sets none."""
    return DEFAULT_TOLERANCE[(kind, error_feedback)]


__all__ = [
    "DEFAULT_TOLERANCE",
    "ENCODINGS",
    "INT8_BLOCK",
    "SIGN_BLOCK",
    "Encoded",
    "UpdateEncoding",
    "default_tolerance",
]
