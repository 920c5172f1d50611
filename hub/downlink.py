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

from collections.abc import Mapping

from gpuflex.protocol.encoding import UpdateEncoding
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
    residual) over the whole model; tensors that are not floating are taken from ``new``."""
    enc = UpdateEncoding("topk", fraction, error_feedback=True)
    change = {k: new[k] - v for k, v in old.items() if v.is_floating_point()}
    out = enc.encode(change, residual or None)
    sent = enc.decode(out.wire, manifest_of(change))
    published = {k: (v + sent[k].to(v.dtype)) if v.is_floating_point() else new[k].clone() for k, v in old.items()}
    return published, dict(out.residual or {})
