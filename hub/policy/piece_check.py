"""The referee's check of one expert's or one tensor slice's work on one micro-batch.

A host of experts or of a slice of a layer split by width records, for the micro-batches its
caller chose, what it computed (protocol/piececall.py: the input it was sent, its answer, the
gradient it was sent back, the input's gradient it answered, the hash of its parameters). The
referee rebuilds the piece from the parameters it should have held (the layer's durable state:
an expert is the mixture of experts' ``experts.<index>.*``, built as the transformer builds it,
protocol/moe.py; a slice is cut from the whole layer's ``weight`` and ``bias``, or from an
attention's ``qkv`` and ``proj`` by heads, as the parties cut it, protocol/tensorslices.py),
re-executes the forward on the input and the backward on the gradient it was sent, and compares
as a pipeline stage's check does (hub/policy/stage_check.py): relative L2 distance of the sent
answer to the recomputed one (``forward_distance``) and of the answered input gradient to the
recomputed one (``backward_distance``), each within the same ``tolerance``
(``stage_tolerance``: the job's strict one for fp32). A host that reports parameters whose hash
is not the durable state's computed with other parameters: a mismatch, whatever the distances.

Evidence that cannot be judged (an expert the layer does not have, an answer with another
number of tokens than it was sent, a slice's tensor of the wrong shape, a NaN) is refused with a
one-line :class:`Unprocessable` before anything is re-executed.
Pure: tensors in, a verdict out; blocking (a caller on the event loop runs it in a thread).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import torch
from gpuflex.protocol.errors import ProtocolError, SpecError
from gpuflex.protocol.modelspec import ModelSpec
from gpuflex.protocol.piececall import EXPERT, PieceCall, piece_hash
from gpuflex.protocol.pipeline import load_unit, moe_units
from gpuflex.protocol.tensors import is_blob_id
from gpuflex.protocol.tensorslices import MODES, HeadSlice, cut_slice
from torch import Tensor, nn

from ..base.errors import Unprocessable
from .stage_check import StageVerdict, relative_distance

__all__ = ["expert_state", "judge_expert", "judge_slice"]


def _refuse(what: str) -> Unprocessable:
    return Unprocessable(f"{what}; refused", code="bad_evidence")


def _check_tensors(call: PieceCall) -> None:
    """Every tensor floating and finite; the gradients both present or both absent, each of its
    tensor's shape."""
    tensors = {"x": call.x, "out": call.out, "grad_out": call.grad_out, "grad_in": call.grad_in}
    for name, t in tensors.items():
        if t is None:
            continue
        if not t.is_floating_point():
            raise _refuse(f"the call's {name} is {t.dtype}, not floating point")
        if not bool(torch.isfinite(t).all()):
            raise _refuse(f"the call's {name} holds NaN or inf")
    if (call.grad_out is None) != (call.grad_in is None):
        raise _refuse("the call has one of its gradients without the other")
    if call.grad_out is not None and call.grad_out.shape != call.out.shape:
        raise _refuse(
            f"the call's grad_out has shape {list(call.grad_out.shape)}, its answer "
            f"{list(call.out.shape)}"
        )
    if call.grad_in is not None and call.grad_in.shape != call.x.shape:
        raise _refuse(
            f"the call's grad_in has shape {list(call.grad_in.shape)}, its input "
            f"{list(call.x.shape)}"
        )
    if not is_blob_id(call.params):
        raise _refuse(f"the call's parameter hash {str(call.params)[:80]!r} is not a sha256")


def expert_state(moe_state: Mapping[str, Tensor], index: int) -> dict[str, Tensor]:
    """Expert ``index``'s own state (``fc.weight``...) out of its mixture of experts' state
    (``experts.<index>.fc.weight``...)."""
    prefix = f"experts.{index}."
    return {k[len(prefix) :]: v for k, v in moe_state.items() if k.startswith(prefix)}


def judge_expert(
    spec: ModelSpec,
    moe_state: Mapping[str, Tensor],
    call: PieceCall,
    *,
    tolerance: float,
    held: Collection[int] | None = None,
    block: int | None = None,
) -> StageVerdict:
    """Re-execute expert ``call.index`` of block ``block``'s mixture of experts of the
    transformer ``spec`` (None: the first that is one; without LoRA targets naming blocks,
    every block's experts are built alike), whose durable state is
    ``moe_state`` (the MoE module's own names: ``router.weight``, ``experts.<e>.fc.weight``...),
    on ``call`` (module docstring); ``held``: the experts the placement gives the host (None:
    any of the layer's). The expert is built as a host builds it (protocol.pipeline.moe_units),
    so a LoRA job's expert holds its frozen weights in int8 and its adapters as the host's did.
    Unprocessable for evidence that cannot be judged."""
    config = spec.transformer
    if config is None or config.experts < 1:
        raise _refuse(f"a {spec.kind} model without experts has no expert {call.index}")
    if call.kind != EXPERT:
        raise _refuse(f"a call of a {call.kind!r} is not an expert's")
    if not 0 <= call.index < config.experts:
        raise _refuse(f"the call names expert {call.index}; the layer has {config.experts}")
    if held is not None and call.index not in held:
        raise _refuse(
            f"the call names expert {call.index}; the placement gives the host {sorted(held)}"
        )
    width = config.width
    if call.x.dim() != 2 or int(call.x.shape[1]) != width:
        raise _refuse(
            f"expert {call.index} was sent tokens of shape {list(call.x.shape)}; it takes "
            f"[tokens, {width}]"
        )
    if call.out.shape != call.x.shape:
        raise _refuse(
            f"expert {call.index} answered {list(call.out.shape)} for the "
            f"{list(call.x.shape)} tokens it was sent"
        )
    _check_tensors(call)
    try:
        unit = moe_units(spec, config.moe_every - 1 if block is None else block).experts[call.index]
    except SpecError as exc:
        raise _refuse(str(exc)) from None
    state = expert_state(moe_state, call.index)
    try:
        expert = load_unit(unit, state)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:160]
        raise _refuse(f"expert {call.index}'s durable state does not load: {first}") from None
    return _replay(expert, piece_hash(state), call, tolerance, check="expert_replay")


def judge_slice(
    layer_state: Mapping[str, Tensor],
    call: PieceCall,
    *,
    parties: int,
    tolerance: float,
    heads: int = 0,
) -> StageVerdict:
    """Re-execute slice ``call.index`` of a layer cut ``parties`` ways by ``call.kind``, whose
    durable state is ``layer_state`` (a Linear's ``weight`` and ``bias``; an attention's
    ``qkv.*`` and ``proj.*``, cut into ``heads``), on ``call`` (module docstring);
    Unprocessable for evidence that cannot be judged."""
    if call.kind not in MODES:
        raise _refuse(f"a call of a {call.kind!r} is not a slice's ({', '.join(MODES)})")
    try:
        piece = cut_slice(call.kind, layer_state, parties, call.index, heads=heads)
    except ProtocolError as exc:
        raise _refuse(str(exc)) from None
    in_features, out_features = _widths(piece)
    x, out = call.x, call.out
    if x.dim() != 3 or int(x.shape[2]) != in_features:
        raise _refuse(
            f"slice {call.index} ({call.kind}) was sent an input of shape {list(x.shape)}; it "
            f"takes [batch, time, {in_features}]"
        )
    if out.shape != (*x.shape[:2], out_features):
        raise _refuse(
            f"slice {call.index} ({call.kind}) answered {list(out.shape)} for an input of shape "
            f"{list(x.shape)}; its answer is [{int(x.shape[0])}, {int(x.shape[1])}, {out_features}]"
        )
    _check_tensors(call)
    return _replay(piece, piece_hash(piece.state_dict()), call, tolerance, check="slice_replay")


def _widths(piece: nn.Module) -> tuple[int, int]:
    """A slice's input and output features (a head slice answers in the attention's width)."""
    if isinstance(piece, HeadSlice):
        return piece.qkv.in_features, piece.qkv.in_features
    if isinstance(piece, nn.Linear):
        return piece.in_features, piece.out_features
    raise TypeError(f"a slice is a Linear or a HeadSlice, not {type(piece).__name__}")


def _replay(
    piece: nn.Module, durable: str, call: PieceCall, tolerance: float, *, check: str
) -> StageVerdict:
    """Re-run ``piece`` forward on the call's input and backward on its gradient; compare."""
    found: dict[str, Any] = {
        "check": check,
        "kind": call.kind,
        "index": call.index,
        "step": call.step,
        "micro_batch": call.micro_batch,
        "params": call.params,
        "durable_params": durable,
        "threshold": tolerance,
    }
    x = call.x.detach().to(torch.float32).clone().requires_grad_(call.grad_out is not None)
    piece.train()
    out = piece(x)
    found["forward_distance"] = relative_distance(call.out, out.detach())
    if call.grad_out is not None and call.grad_in is not None:
        out.backward(call.grad_out.to(out.dtype))
        recomputed = x.grad if x.grad is not None else torch.zeros_like(x)
        found["backward_distance"] = relative_distance(call.grad_in, recomputed.detach())
    far = [k for k, v in found.items() if k.endswith("_distance") and not v <= tolerance]
    same = call.params == durable
    if same and not far:
        found["why"] = f"{check}: reproduced within {tolerance:g}"
    elif not same:
        found["why"] = (
            f"{check}: computed with parameters {call.params[:12]}..., the durable state's are "
            f"{durable[:12]}..."
        )
    else:
        gaps = ", ".join(f"{k} {found[k]:.3g}" for k in far)
        found["why"] = f"{check}: did not reproduce ({gaps} > {tolerance:g})"
    shown = {
        k: (v if not isinstance(v, float) or math.isfinite(v) else 1e300) for k, v in found.items()
    }
    return StageVerdict(same and not far, shown)
