"""The model's change made sparse, so the next model downloads as a small delta.

With ``[communication] download = "topk"`` the hub does to its own outer step what a node's
topk encoding does to an update (protocol/encoding.py, with error feedback): of the change the
round's aggregation and server optimizer made, the ``download_fraction`` largest elements over
the whole model are applied, and the rest is carried to the next round in the hub's own
residual (kept with the server optimizer's state, so it survives a restart). The model a round
publishes then differs from the last in that fraction of its elements only, and the GFD1 delta
a node holding the last model downloads (protocol/blobdelta.py: XOR, byte shuffle, deflate) is
mostly zeros. Bidirectional compression in the manner of DoubleSqueeze (Tang et al. 2019).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from gpuflex.protocol.encoding import TOPK_VALUE, UpdateEncoding, _top_positions
from gpuflex.protocol.errors import TensorError
from gpuflex.protocol.tensors import manifest_of
from torch import Tensor

#: the server optimizer state's keys that hold the download residual
RESIDUAL_PREFIX = "download."


def split_state(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(server optimizer state, download residual) from the stored blob's tensors."""
    n = len(RESIDUAL_PREFIX)
    opt = {k: v for k, v in state.items() if not k.startswith(RESIDUAL_PREFIX)}
    residual = {k[n:]: v for k, v in state.items() if k.startswith(RESIDUAL_PREFIX)}
    return opt, residual


def sparse_step(old: Mapping[str, Tensor], new: Mapping[str, Tensor], fraction: float,
                residual: Mapping[str, Tensor] | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the model to publish, the residual to keep): ``old`` plus the topk of (new - old +
    residual) over the whole model; tensors that are not floating are taken from ``new``.

    What ``UpdateEncoding("topk", fraction, error_feedback=True)`` would encode and decode, bit
    for bit, in two passes over the model (``_encode_decode`` is that definition, and what a
    model with other than float32 CPU tensors takes): the change and the residual are summed
    into one flat buffer that becomes the new residual once the kept elements are zeroed, and
    the published tensors are ``old + 0.0`` (a signed zero adds as the decoded zeros would)
    with the kept elements added where they are."""
    if not _fusable(old, new, residual or {}):
        return _encode_decode(old, new, fraction, residual)
    enc = UpdateEncoding("topk", fraction, error_feedback=True)
    floating = [(k, v) for k, v in old.items() if v.is_floating_point()]
    sizes = [v.numel() for _, v in floating]
    total = sum(sizes)
    with torch.no_grad():
        flat = torch.empty(total, dtype=torch.float32)  # x = new - old + residual, then the residual
        at = 0
        for (k, v), n in zip(floating, sizes, strict=True):
            x = flat[at:at + n].view(v.shape)
            torch.sub(new[k], v, out=x)
            if residual and k in residual:
                x.add_(residual[k])
            at += n
        idx = _top_positions(flat, enc.kept(total))
        values = flat[idx]
        if idx.numel() and not bool(torch.isfinite(values).all()):  # as the wire's check refuses it
            raise TensorError(f"tensor {TOPK_VALUE!r} contains NaN or infinite values")
        flat[idx] = 0.0  # x - decode(encode(x)): exactly zero where kept, x elsewhere
        cuts = torch.searchsorted(idx, torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64))
        published: dict[str, Tensor] = {}
        kept: dict[str, Tensor] = {}
        at = 0
        for i, ((k, v), n) in enumerate(zip(floating, sizes, strict=True)):
            p = torch.add(v, 0.0)
            lo, hi = int(cuts[i]), int(cuts[i + 1])
            if hi > lo:
                local = idx[lo:hi] - at
                p.view(-1)[local] = v.reshape(-1)[local] + values[lo:hi]
            published[k] = p
            kept[k] = flat[at:at + n].view(v.shape)
            at += n
    out = {k: published[k] if k in published else new[k].clone() for k in old}
    return out, kept


def _fusable(old: Mapping[str, Tensor], new: Mapping[str, Tensor], residual: Mapping[str, Tensor]) -> bool:
    """float32 CPU tensors of matching shapes throughout (and at least one)."""
    f32 = torch.float32
    floating = [(k, v) for k, v in old.items() if v.is_floating_point()]
    if not floating:
        return False
    for k, v in floating:
        n = new.get(k)
        r = residual.get(k, v)
        if n is None or any(t.dtype != f32 or t.device.type != "cpu" or t.shape != v.shape for t in (v, n, r)):
            return False
    return True


def _encode_decode(old: Mapping[str, Tensor], new: Mapping[str, Tensor], fraction: float,
                   residual: Mapping[str, Tensor] | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``sparse_step`` by the encoding itself: encode the change with feedback, decode the wire."""
    enc = UpdateEncoding("topk", fraction, error_feedback=True)
    change = {k: new[k] - v for k, v in old.items() if v.is_floating_point()}
    out = enc.encode(change, residual or None)
    sent = enc.decode(out.wire, manifest_of(change))
    published = {k: (v + sent[k].to(v.dtype)) if v.is_floating_point() else new[k].clone() for k, v in old.items()}
    return published, dict(out.residual or {})
