"""The pipeline relay's messages (hub/server/relay.py; node/pipeline/relay.py): the header a
stage seals over each tensor it sends, and the request that takes one. Re-exported by
protocol/messages.py, whose registry (MESSAGE_TYPES) holds them like every other message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Final

from .fields import BlobIdStr, Bytes, Count, Float, IdStr, Int, Nonce, Text, Timestamp

#: the largest stage sketch a relay header carries (protocol/stagesketch.py: its header,
#: ``SKETCH_ENTRIES`` (index, value) pairs and ``SKETCH_PROJECTIONS`` sums); here, so that the
#: messages import without torch
MAX_SKETCH_BYTES: Final = 1024

#: what a relay message carries between two pipeline stages: a micro-batch's activation (stage
#: s -> s+1), its gradient (s -> s-1), or a tied parameter's gradient (two stages of one tied group);
#: between a mixture-of-experts layer's router and an expert host: the tokens each of the host's
#: experts gets ("expert_route", int64 counts), the tokens ("expert_in"), the experts' outputs
#: ("expert_out"), and their gradients ("expert_grad", either way); between a layer split by width
#: and one of its slices: the input's shape ("slice_shape"), the input ("slice_in"), the slice's
#: output ("slice_out") and the gradients ("slice_grad", either way) (node/pipeline/remote.py);
#: after a router found an expert host lost, the second round of the same call to each live host:
#: the counts of the tokens re-routed to its experts ("expert_reroute", zeros when none), those
#: tokens ("reroute_in") and the experts' outputs ("reroute_out") (node/pipeline/experts.py);
#: between the same stage of two pipelines of one step (hybrid parallelism): one unit's summed
#: parameter gradients, flattened ("replica", its micro-batch the unit's place in the stage)
# fmt: off
RELAY_KINDS: Final = (
    "activation", "gradient", "tied",
    "expert_route", "expert_in", "expert_out", "expert_grad",
    "expert_reroute", "reroute_in", "reroute_out",
    "slice_shape", "slice_in", "slice_out", "slice_grad",
    "replica",
)
# fmt: on


@dataclass(frozen=True)
class RelayHeader:
    """Node -> hub, POST /v1/relay (header X-GPUFlex-Relay; the body is one GFT1 tensor of
    ``size`` bytes and SHA-256 ``sha256``): one tensor from stage ``stage`` to stage
    ``to_stage`` of ``job_id``'s pipeline at ``step``. The hub hands this sealed header on,
    as it came, with the body, so the receiving stage checks the sender's signature itself."""

    KIND: ClassVar[str] = "relay"
    job_id: IdStr
    step: Annotated[int, Int(0, 1 << 40)]
    micro_batch: Annotated[int, Int(0, 1 << 16)]
    carries: Annotated[str, Text(16, choices=RELAY_KINDS)]
    stage: Annotated[int, Int(0, 1 << 10)]
    to_stage: Annotated[int, Int(0, 1 << 10)]
    sha256: BlobIdStr
    size: Count
    timestamp: Timestamp
    nonce: Nonce
    #: the pipeline plan's generation (StageAssignment.generation); a re-plan starts a new one,
    #: and the relay refuses a message of any other (code ``stale_generation``)
    generation: Annotated[int, Int(0, 1 << 31)] = 0
    #: the sending stage's sketch of the raw tensor before its boundary code encodes it
    #: (protocol/stagesketch.py; only an activation or a gradient, at the steps the hub may
    #: check): what the referee compares its recomputation with where the code throws detail away
    sketch: Annotated[bytes, Bytes(MAX_SKETCH_BYTES)] = b""


@dataclass(frozen=True)
class RelayTake:
    """Node -> hub, GET /v1/relay (header X-GPUFlex-Auth): take the tensor that stage ``stage``
    sent stage ``to_stage`` (the taker's own) at ``step``; the hub waits up to ``wait_s``."""

    KIND: ClassVar[str] = "relay_take"
    job_id: IdStr
    step: Annotated[int, Int(0, 1 << 40)]
    micro_batch: Annotated[int, Int(0, 1 << 16)]
    carries: Annotated[str, Text(16, choices=RELAY_KINDS)]
    stage: Annotated[int, Int(0, 1 << 10)]
    to_stage: Annotated[int, Int(0, 1 << 10)]
    wait_s: Annotated[float, Float(0.0, 60.0)]
    timestamp: Timestamp
    nonce: Nonce
    generation: Annotated[int, Int(0, 1 << 31)] = 0


__all__ = ["RELAY_KINDS", "RelayHeader", "RelayTake"]
