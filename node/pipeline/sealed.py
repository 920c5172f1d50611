"""A pipeline tensor as it travels, by the relay or directly: one GFT1 blob (protocol/tensors.py)
and the sender's sealed ``RelayHeader`` naming the job, the plan's generation, the step, the
micro-batch, what it carries, both stages and the blob's size and SHA-256.

Every receiver checks a message the same way, in this order: the header's signature (by the
sending stage's key when ``peers`` names it), the header's fields against the message it
expects (``open_header``), then the bytes against the header's size and hash, their size
against the expected tensor's, and the decoded tensor's name, shape, dtype and finiteness
(``open_body``). Each refusal is one PipelineError line.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping

import torch
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import RelayHeader
from gpuflex.protocol.signing import SigningKey, fingerprint, new_nonce, open_sealed, seal
from gpuflex.protocol.tensors import TensorSpec, decode_state, encode_state, max_encoded_size

from ..errors import PipelineError
from .transport import MessageKey, check_received


def encode_tensor(key: MessageKey, tensor: torch.Tensor) -> bytes:
    """The GFT1 blob of ``tensor`` under ``key.carries`` (a copy: the caller may reuse ``tensor``)."""
    return encode_state({key.carries: tensor.detach().to("cpu").contiguous()})


def seal_header(
    signer: SigningKey,
    job_id: str,
    key: MessageKey,
    body: bytes | bytearray | memoryview,
    *,
    generation: int = 0,
    clock: Callable[[], float] = time.time,
) -> bytes:
    """The sender's sealed header for ``body`` sent under ``key`` (a fresh nonce each call)."""
    return seal(
        signer,
        RelayHeader(
            job_id=job_id,
            step=key.step,
            micro_batch=key.micro_batch,
            carries=key.carries,
            stage=key.stage,
            to_stage=key.to_stage,
            sha256=hashlib.sha256(body).hexdigest(),
            size=len(body),
            timestamp=clock(),
            nonce=new_nonce(),
            generation=generation,
        ),
    )


def open_header(
    sealed: bytes,
    *,
    job_id: str,
    peers: Mapping[int, bytes],
    generation: int = 0,
    key: MessageKey | None = None,
    known_senders_only: bool = False,
) -> tuple[RelayHeader, MessageKey]:
    """The sender's header, checked: its signature; the signer is the key ``peers`` gives for the
    sending stage (any signer when ``peers`` does not name it, unless ``known_senders_only``); the
    job and generation are this pipeline's; with ``key``, it is that message's header."""
    what = key.describe() if key is not None else "a pipeline message"
    try:
        hdr, signer = open_sealed(
            sealed, RelayHeader, signer=peers.get(key.stage) if key is not None else None
        )
        got = MessageKey(hdr.step, hdr.micro_batch, hdr.carries, hdr.stage, hdr.to_stage)
    except (ValueError, ProtocolError, PipelineError) as exc:
        raise PipelineError(f"{what} came without a valid signed header: {exc}") from None
    want_signer = peers.get(got.stage)
    if want_signer is None and known_senders_only:
        raise PipelineError(
            f"{got.describe()} is signed by {fingerprint(signer)}, which runs no stage of "
            "this pipeline; refused"
        )
    if want_signer is not None and signer != want_signer:
        raise PipelineError(
            f"{got.describe()} is signed by {fingerprint(signer)}, not by stage {got.stage}'s node"
        )
    if hdr.job_id != job_id or (key is not None and got != key):
        raise PipelineError(f"{what} came with the header of another message")
    if hdr.generation != generation:
        raise PipelineError(
            f"{got.describe()} belongs to the plan's generation {hdr.generation}, "
            f"this stage runs generation {generation}"
        )
    return hdr, got


def open_body(
    hdr: RelayHeader,
    body: bytes | bytearray,
    key: MessageKey,
    expected: TensorSpec,
) -> torch.Tensor:
    """The tensor in ``body``, once its bytes match the header's size and SHA-256 and it is
    ``expected``'s size, shape and dtype, finite. A fresh tensor the caller owns (it shares
    memory with ``body`` when that is a bytearray, which the caller hands over)."""
    if len(body) != hdr.size or hashlib.sha256(body).hexdigest() != hdr.sha256:
        raise PipelineError(f"{key.describe()} does not match its signed size and SHA-256")
    if len(body) > max_encoded_size((TensorSpec(key.carries, expected.dtype, expected.shape),)):
        raise PipelineError(
            f"{key.describe()} is larger than a {expected.dtype} {list(expected.shape)} tensor"
        )
    try:
        state = decode_state(body)
    except ProtocolError as exc:
        raise PipelineError(f"{key.describe()} is not a valid tensor: {exc}") from None
    if set(state) != {key.carries}:
        raise PipelineError(
            f"{key.describe()} holds tensors {sorted(state)[:4]}, expected one named {key.carries!r}"
        )
    tensor = state[key.carries]
    # a view of read-only bytes must not be written to: copied; a bytearray is the receiver's own
    return check_received(key, tensor if isinstance(body, bytearray) else tensor.clone(), expected)


__all__ = ["encode_tensor", "open_body", "open_header", "seal_header"]
