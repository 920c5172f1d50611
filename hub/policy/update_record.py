"""An accepted update as verification sees it, and the flag raised against one.

The shared vocabulary of the verification modules (hub/policy/replica_comparison.py,
hub/policy/round_review.py, hub/policy/reputation.py): ``UpdateRecord`` in, ``Flag`` out.
A flag's ``evidence`` is the JSON the auditors are shown and the store keeps; ``jsonable``
makes a float fit it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..base.errors import HubError
from .fingerprints import Fingerprint

__all__ = ["EPS", "REASONS", "Flag", "UpdateRecord", "VerificationError", "jsonable"]

REASONS = ("replica_mismatch", "outlier", "free_rider", "implausible")
EPS = 1e-12


class VerificationError(HubError):
    """The hub called verification with inputs that cannot be judged (a bug upstream)."""

    status = 500
    code = "verification_error"


@dataclass(frozen=True)
class UpdateRecord:
    """One accepted update as verification sees it.

    ``samples_claimed`` is the header's sample_count, ``shard_samples`` what the
    hub's shard actually holds; ``loss``/``train_s`` are the node's claims;
    ``node_samples_per_s`` is the node's throughput as the hub knows it (evidence
    only: delivered throughput includes download and polling, so it is no bound).
    ``elapsed_s`` (optional) is the hub-observed wall time from assignment issue
    to upload: a node cannot have trained longer than that.
    ``peak_flops`` (the node's best benchmarked matmul FLOP/s; 0 = unknown),
    ``param_count`` and ``local_epochs`` give the PHYSICAL minimum training time,
    6 * params * samples * epochs / (peak * FLOP_SAFETY); a claim below it is
    implausible (skipped when that minimum is under MIN_TIMING_S).
    ``delta`` may be zero-copy views; it is only read.
    """

    update_id: str
    node_id: str
    shard_id: str
    samples_claimed: int
    shard_samples: int
    loss: float
    train_s: float
    node_samples_per_s: float
    delta: Mapping[str, Tensor]
    elapsed_s: float | None = None
    peak_flops: float = 0.0
    param_count: int = 0
    #: passes over the shard the assignment asked for (local_steps makes it fractional)
    local_epochs: float = 1
    #: the sum of the segment norms the node committed to (an uncoded update with a checkpoint
    #: commitment; None: not checked). By the triangle inequality the update (last checkpoint
    #: minus first) is no longer than that path. The referee tests the norms of the segments whose
    #: states an audit fetched; this bounds the claims of every update, audited or not.
    path_length: float | None = None
    #: the factor on the job's lr this update's shard trained with ([train] lr_scaling)
    lr_scale: float = 1.0
    #: the sha256 of the update as uploaded (its blob), when known: replicas with equal shas hold
    #: the same bytes, at distance 0 without a look at their tensors. Set only for an update
    #: whose every value is finite (the hub's uploads: check_blob refuses any other)
    sha: str | None = None
    #: ``delta``'s fingerprint (hub/policy/fingerprints.py) when one was taken before; None:
    #: replica comparison takes it when it first needs it
    fingerprint: Fingerprint | None = None

    @property
    def work(self) -> float:
        """What an update's size is compared by: its shard's samples times its lr factor (an
        update moves the model about in proportion to both)."""
        return max(self.shard_samples, 1) * self.lr_scale


@dataclass(frozen=True)
class Flag:
    """A suspicion with its evidence (JSON-serializable: str, int, float, list, dict)."""

    update_id: str
    node_id: str
    reason: str
    evidence: dict[str, Any]


def jsonable(x: float) -> float | str:
    """Evidence goes to JSON: non-finite floats become strings."""
    return x if math.isfinite(x) else repr(x)
