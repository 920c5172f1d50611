"""Verification of contributed updates: replicas, outlier scores, reputation.

Pure functions: records in, verdicts out; no I/O, no clocks, no
global state, inputs never mutated. The hub decides *when* to call them and
persists what they return; an auditor later confirms or dismisses each `Flag`.

This module is the map; each decision lives in a module named after it:

- hub/policy/update_record.py: ``UpdateRecord`` (an accepted update) and ``Flag`` (a suspicion
  with the evidence auditors are shown);
- hub/policy/distances.py: relative distance, cosines and norms, the model's trend;
- hub/policy/replica_comparison.py: ``compare_replicas``, does a replica group agree;
- hub/policy/round_review.py: ``review_round``, the free-rider, plausibility and outlier scores;
- hub/policy/reputation.py: ``Reputation`` and its transitions, trust and replication.

The names below are re-exported here, so ``verification.X`` keeps naming each of them.

How the pieces fit in one round (the round policy that combines them is
hub/policy/round_policy.py; hub/domain/rounds.py applies its decisions):

1. When a node gets a shard the hub asks ``should_replicate(rep, spec, rng)``
   with the node's `Reputation`. If true the shard gets a ``replica_group`` and
   is handed out again, with the same seed and chunks, to a *distinct* node from
   ``replica_candidates`` (trusted nodes when there are any).
2. When a group has ``quorum`` updates, ``compare_replicas`` runs. Updates that
   agree (relative distance within ``tolerance``) form clusters; a cluster of at
   least ``quorum`` that is a strict majority of the group stands and the rest
   are flagged ``replica_mismatch``. Without such a majority it asks for another
   replica (``needs_more``) until ``max_replicas``; at ``max_replicas`` with no
   majority every update in the group is flagged (an auditor decides). A group
   with no trusted member needs one more agreeing replica and a split among
   untrusted nodes accuses nobody (deterministic attacks agree with themselves).
   One update of an agreeing group (``ReplicaOutcome.canonical``) represents the
   shard in the aggregate, so replication never double-counts a shard.
3. ``review_round`` scores every candidate update of the round (the canonical
   update of each replicated shard plus the unreplicated ones):
   ``free_rider`` (near-zero update), ``implausible`` (claims that do not fit the
   shard: sample count, loss, a training time below the physical minimum for
   the node's benchmarked FLOP/s or above the hub-observed wall time, an
   update longer than the path its committed segment norms add up to),
   ``outlier`` (cosine to the round's coordinate-wise median of per-sample
   updates below the threshold described below, or norm per sample above
   ``norm_ratio_max`` times the round's median). Flagged updates are
   quarantined: kept, shown to auditors, left out of the aggregate.
4. Reputation transitions (``record_agreement``, ``record_flag``,
   ``record_verdict``) are pure: they return a new `Reputation`.

Calibration (measured; the figures are in docs/verification.md): honest replicas
on the same device type and thread count are bit-identical (relative distance
0.0). The digits MLP at the contract's defaults is bit-identical even between
torch threads 1 and 2 (its matmuls are too small to split); a 64-1024-1024-10
MLP at batch 128 differs by at most 1.2e-6. The default ``tolerance = 1e-4``
leaves ~100x margin above that, while every attack in tests/tooling/attacks.py
sits at >= 1e-2. Thresholds: honest per-sample norm ratios stayed <= 2.10 over
60-round digits runs with shards of 1 to 6 chunks, hence ``norm_ratio_max = 4``. That bound
holds for a shard of the round's median size and widens by sqrt of the size ratio, either way,
for others (``size_allowance``): per-sample norms are not size-free.

Cosine threshold: honest updates of small shards late in training are mostly
gradient noise (measured: -0.47 to the median after 47 digits rounds on a
1-chunk shard). So the spec's ``cosine_min`` is the threshold for a shard of the
round's median size in a round whose cosines are tight; it is relaxed to
``median - 4 x robust spread`` of the round's cosines when that is lower, and
both terms widen by sqrt(median samples / own samples) for smaller shards.

Honest false positives: with fewer than ``MIN_OUTLIER_N`` (3) candidate updates
the median is not a robust centre (with 2 it is their mean, so each is "half
the distance" from it), so outlier scoring is skipped and only free_rider and
implausible checks run; the skip is stated in ``RoundReview.evidence``.
"""

from __future__ import annotations

from .distances import cosine_and_norms, layer_of, relative_distance, trend_alignment
from .replica_comparison import ReplicaOutcome, ReplicaPair, compare_replicas
from .reputation import (
    BAN_AFTER_CONFIRMED,
    MIN_REPLICATION,
    ReplicaPool,
    Reputation,
    is_trusted,
    record_agreement,
    record_flag,
    record_missed,
    record_verdict,
    record_withdrawn,
    replica_candidates,
    replication_probability,
    should_replicate,
)
from .round_review import MIN_OUTLIER_N, RoundReview, review_round, size_allowance
from .update_record import REASONS, Flag, UpdateRecord, VerificationError

__all__ = [
    "BAN_AFTER_CONFIRMED",
    "MIN_OUTLIER_N",
    "MIN_REPLICATION",
    "REASONS",
    "Flag",
    "ReplicaOutcome",
    "ReplicaPair",
    "ReplicaPool",
    "Reputation",
    "RoundReview",
    "UpdateRecord",
    "VerificationError",
    "compare_replicas",
    "cosine_and_norms",
    "is_trusted",
    "layer_of",
    "record_agreement",
    "record_flag",
    "record_missed",
    "record_verdict",
    "record_withdrawn",
    "relative_distance",
    "replica_candidates",
    "replication_probability",
    "review_round",
    "should_replicate",
    "size_allowance",
    "trend_alignment",
]
