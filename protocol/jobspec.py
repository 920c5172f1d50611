"""Job specs: a TOML file validated into frozen dataclasses.

Sections: ``[job]``, ``[model]`` (see :mod:`.modelspec`), ``[train]``,
``[data]``, ``[aggregation]``, ``[verification]``, ``[communication]``, ``[privacy]``.
Unknown sections or keys and bad values raise SpecError naming ``section.key`` and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .compute import JOB_PRECISIONS
from .encoding import ENCODINGS, UpdateEncoding, default_tolerance
from .errors import SpecError, TensorError
from .finetune import apply_finetune, check_finetune, without_lora
from .messages import TrainConfig
from .modelspec import ModelSpec, manifest
from .pipelinespec import PipelineSpec, parse_pipeline
from .workload import assignment_steps, samples_processed

MAX_SPEC_BYTES: Final = 1 << 20
MAX_SEED: Final = (1 << 63) - 1

OPTIMIZERS: Final = ("sgd", "adam", "adamw")
LR_SCALINGS: Final = ("none", "linear")
LOSSES: Final = ("cross_entropy", "mse")
SPLITS: Final = ("random", "stratified")
METHODS: Final = ("fedavg", "median", "trimmed_mean", "krum", "multi_krum", "bulyan")
SERVER_OPTIMIZERS: Final = ("none", "fedavgm", "fedadam", "nesterov")  # append only: codes are stored
UNVERIFIED: Final = ("accept", "hold")
DOWNLOADS: Final = ("full", "topk")
#: where a job's training data lives: uploaded to the hub, or in silos on the nodes
DATA_SOURCES: Final = ("hub", "node-local")
MAX_SILO_SAMPLES: Final = 50_000_000
#: [data] keys that only a node-local job may set
SILO_KEYS: Final = ("min_samples", "max_samples", "label_histogram", "quorum", "round_deadline_s", "late")
#: what becomes of an update still training when a node-local round closes
LATE: Final = ("drop", "next")
#: [privacy] dp: off, or central differential privacy (the hub clips and adds the noise)
DP_MODES: Final = ("off", "central")
#: [privacy] keys that only dp = "central" may set
PRIVACY_KEYS: Final = ("clip_norm", "noise_multiplier", "delta")
SECAGG_KEYS: Final = ("secagg_clip", "secagg_bits", "secagg_phase_s")
#: [aggregation] strategy: the names a spec's other fields mean (``derived_strategy``); any other
#: name is a strategy registered in the hub's code (hub/policy/strategy.py), which the hub checks
DERIVED_STRATEGIES: Final = (*METHODS, "fedavgm", "fedadam", "central_dp", "secure_aggregation")
STRATEGY_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,47}")


@dataclass(frozen=True)
class TrainSpec:
    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    loss: str = "cross_entropy"
    seed: int = 0
    grad_clip: float = 0.0
    round_target_s: float = 10.0
    deadline_slack: float = 3.0
    #: fp32 | tf32 | bf16 | fp16, or "auto": each node's fastest (protocol/compute.auto_precision:
    #: bf16 on CUDA cc >= 8.0, fp16 on older CUDA, fp32 on a CPU or MPS)
    precision: str = "auto"
    #: optimizer steps per assignment, in place of local_epochs passes (0: local_epochs decide).
    #: With [aggregation] server_optimizer = "nesterov" this is a DiLoCo round: a fixed amount of
    #: local work per model sent, whatever the shard's size
    local_steps: int = 0
    #: "linear": a round's shards train with lr x (round's samples / shard's samples), capped at
    #: lr_scale_max (the linear scaling rule of data-parallel SGD: FedAvg's weighted mean of k
    #: half-as-long trainings moves the model about 1/k as far as one training over the round's
    #: data; scaled, each shard's update stands for the whole round's). "none": every shard trains
    #: with lr
    lr_scaling: str = "none"
    lr_scale_max: float = 8.0

    def lr_scale(self, shard_samples: int, round_samples: int) -> float:
        """The factor on ``lr`` for a shard of ``shard_samples`` in a round of ``round_samples``."""
        if self.lr_scaling != "linear" or shard_samples <= 0:
            return 1.0
        return min(float(self.lr_scale_max), max(1.0, round_samples / shard_samples))

    def train_config(self, precision: str | None = None) -> TrainConfig:
        """The per-assignment training settings sent to nodes. ``precision``: what this node
        trains in (the hub resolves "auto" per node); default: the spec's, "auto" as fp32."""
        if precision is None:
            precision = "fp32" if self.precision == "auto" else self.precision
        return TrainConfig(
            local_epochs=self.local_epochs,
            batch_size=self.batch_size,
            optimizer=self.optimizer,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            beta1=self.beta1,
            beta2=self.beta2,
            loss=self.loss,
            grad_clip=self.grad_clip,
            precision=precision,
            local_steps=self.local_steps,
        )

    def steps(self, samples: int) -> int:
        """Optimizer steps of one assignment over ``samples`` (protocol/workload.py)."""
        return assignment_steps(samples, self.batch_size, self.local_epochs, self.local_steps)

    def processed(self, samples: int) -> int:
        """Samples one assignment over ``samples`` runs through (protocol/workload.py)."""
        return samples_processed(samples, self.batch_size, self.local_epochs, self.local_steps)


@dataclass(frozen=True)
class DataSpec:
    #: samples per chunk; None: the hub sizes chunks from the training set and the nodes online
    #: when the job is submitted, and writes the size into the job's stored spec
    chunk_size: int | None = None
    split: str = "stratified"
    #: held out of the training set when no validation file is given; None: the hub holds out
    #: its default share (10%) when the set is large enough, and writes it into the stored spec
    validation_fraction: float | None = None
    label_column: str = "label"
    #: "hub": the owner uploads the training set and the hub cuts it into chunks; "node-local":
    #: the data stays in silos on the nodes (``gpuflex-node data add``), the hub never gets a row,
    #: and each round trains the silos that are online (docs/silos.md)
    source: str = "hub"
    #: node-local: the fewest samples a silo may hold, and the most its update is weighted by
    #: (a larger silo is refused at ``data add``; the node may keep a subset with --max-samples)
    min_samples: int = 1
    max_samples: int = 1_000_000
    #: node-local: the job asks nodes for their label histogram (an operator still opts in with
    #: ``data add --share-histogram``; without it nothing but the count and hash leaves the node)
    label_histogram: bool = False
    #: node-local: updates a round needs before it may close (it waits, however long, for this
    #: many silos to be attached and deliver) ...
    quorum: int = 2
    #: ... once every online silo has delivered, or this long after the round opened
    round_deadline_s: float = 300.0
    #: node-local: an update still training when its round closes is "drop"ped (its upload is
    #: refused as late) or counts in the "next" round (trained on the model before: one round stale)
    late: str = "drop"

    @property
    def node_local(self) -> bool:
        return self.source == "node-local"


@dataclass(frozen=True)
class AggregationSpec:
    method: str = "fedavg"
    trim_beta: float = 0.1
    krum_f: int = 1
    krum_m: int = 1
    clip_norm: float = 0.0
    server_optimizer: str = "none"
    server_lr: float = 1.0
    server_momentum: float = 0.9
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_eps: float = 1e-3
    #: the aggregation strategy by name; None: the one the fields above and [privacy] mean
    #: (``derived_strategy``)
    strategy: str | None = None


@dataclass(frozen=True)
class VerificationSpec:
    replication: str | float = "adaptive"
    quorum: int = 2
    max_replicas: int = 3
    tolerance: float = 1e-4
    trust_after: int = 10
    cosine_min: float = -0.3  # honest small-shard updates reach -0.1 (verification's measurement)
    norm_ratio_max: float = 4.0
    free_rider_norm: float = 1e-7
    replica_wait_s: float = 30.0
    #: relative L2 distance within which replicas from different compute classes agree. Measured
    #: (bench/class_distance.py): honest fp32 vs bf16 / oneDNN off / threads 1 vs 2 on the digits MLP and
    #: CNN reach 0.049 at 1-3 local epochs and 0.156 at 5; a half-trained shard sits 0.34 or more away.
    cross_class_tolerance: float = 0.2
    #: a replicated shard whose replica never came: "accept" aggregates it (marked unverified in
    #: the audit log and the job status), "hold" keeps it out until a replica agrees
    unverified: str = "accept"
    #: an update whose norm per sample exceeds this x the round's median is scaled down to it
    #: before aggregating (0 = off); hub/policy/round_policy.py judge_round
    norm_bound: float = 2.5
    #: the updates no trusted node vouched for carry at most this share of a round's weight
    #: when trusted updates are in it (1 = no bound); hub/policy/round_policy.py bound_weights
    untrusted_share: float = 0.5
    # -- the referee: checkpoint commitments and segment re-execution (hub/policy/referee.py) --------
    #: steps between two committed checkpoints of an assignment; 0 = about 8 segments an assignment
    checkpoint_every: int = 0
    #: share of settled untrusted shards whose representative the referee re-executes a segment of
    spot_check: float = 0.25
    #: share of shards that would settle on work a trusted node did (mostly unreplicated) whose
    #: representative the referee re-executes a segment of, before it counts: trust saves the
    #: replica, never every check. 1.0 re-executes every trusted update (bench/heterogeneity.py
    #: measures inclusion against cost at several rates)
    spot_check_trusted: float = 0.1
    #: a trusted node whose work has gone unchecked this long is spot-checked at twice that rate
    #: (and one with a short record too, up to 4x: hub/policy/spot_checks.py); 0 = no ageing
    spot_check_stale_s: float = 3600.0
    #: relative distance (re-executed vs committed segment end, over the segment's update) under
    #: which a segment claimed in fp32 reproduces (bench/referee_calibration.py: honest classes
    #: <= 1.1e-6 on the digits MLP and CNN, a bf16 node claiming fp32 >= 9.2e-3)
    segment_tolerance: float = 1e-3
    #: the same for a segment claimed in bf16 / fp16 / tf32: honest bf16 classes on the digits CNN
    #: (oneDNN's bf16 kernels against torch's own) reach 0.035 over 14-step segments and 0.078 over
    #: 28 (segments are at most 16 steps unless checkpoint_every says otherwise)
    segment_tolerance_low: float = 0.15
    #: how long a node has to hand over a requested checkpoint state before it is unverifiable
    state_wait_s: float = 60.0
    #: the model's trend: how it moved over the last this many rounds (model now - model then).
    #: An update any of whose layers points against it (cosine under ``trend_cosine_min``) is
    #: re-executed by the referee before it counts, whatever the spot-check draw; 0 = off.
    #: Measured (bench/heterogeneity.py, 3 jobs x 30 rounds, four compute classes): 23 honest
    #: updates of about 19,000 trainings fell under 0 (all reproduced), and every crafted update
    #: of the patient colluder (its output layer sign-flipped) did: 0 of 25 reached the aggregate.
    #: A colluder that reads this rule keeps its layers just over it (the bench's adaptive one)
    trend_rounds: int = 10
    trend_cosine_min: float = 0.0
    #: the models of this many latest rounds are kept, so the owner can roll the job back to any
    #: of them (hub/policy/rollback.py); older ones leave the blob store. 0 keeps every round's
    keep_rounds: int = 50
    #: roll the job back by itself when a node is suspended or banned whose unverified updates are
    #: in the model (to the round before its first one, or the oldest kept model when that one is
    #: gone, as ``job rollback --before-node --or-oldest-kept`` does)
    auto_rollback: bool = False

    def asks_referee(self) -> bool:
        """Can the referee ever re-execute this job's work? Not when nothing is replicated (no
        disagreement to settle) and nothing is spot-checked; then nodes need not commit."""
        never_replicated = not isinstance(self.replication, str) and float(self.replication) == 0.0
        return not (never_replicated and self.spot_check == 0.0 and self.spot_check_trusted == 0.0)

    def audits_trend(self) -> bool:
        """Are updates that point against the model's trend re-executed before they count? Only
        where the referee works at all (a job that verifies nothing is not audited either)."""
        return self.trend_rounds > 0 and self.trend_cosine_min > -1.0 and self.asks_referee()


@dataclass(frozen=True)
class CommunicationSpec:
    """How updates travel (protocol/encoding.py). ``error_feedback`` and ``tolerance`` are
    resolved at parse time: their defaults depend on ``update``."""

    update: str = "fp32"
    topk_fraction: float = 0.01
    #: carry what the encoding lost into the node's next update of the job (default: on for
    #: topk and sign)
    error_feedback: bool = False
    #: relative distance the encoding adds between honest replicas; added to
    #: verification.tolerance and cross_class_tolerance (protocol/encoding.DEFAULT_TOLERANCE)
    tolerance: float = 0.0
    #: "topk": the hub applies only the largest download_fraction of each round's model change
    #: (the rest carried over, hub/policy/downlink.py), so the next model downloads as a small delta
    download: str = "full"
    download_fraction: float = 0.05

    @property
    def encoding(self) -> UpdateEncoding:
        return UpdateEncoding(self.update, self.topk_fraction, self.error_feedback)


@dataclass(frozen=True)
class PrivacySpec:
    """User-level differential privacy for a node-local job (hub/policy/privacy.py says what it protects
    and which checks it changes). ``dp = "central"``: each round the hub clips every included silo update to L2 norm
    ``clip_norm`` (all its floating tensors together), averages them with equal weights and adds
    Gaussian noise of standard deviation ``noise_multiplier * clip_norm / n`` (n updates) to every
    coordinate of the mean before the server optimizer steps. The unit protected is one silo's
    whole update in a round; ``delta`` is the δ the job's ε is reported at."""

    dp: str = "off"
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    #: secure aggregation (protocol/secagg.py, hub/policy/secagg.py): the hub learns only the sum of
    #: a round's updates. Each node weights its update by its share of ``max_samples``, clips every
    #: coordinate to +-``secagg_clip`` (at least 1: the weight travels as one more coordinate),
    #: quantizes it to ``secagg_bits`` bits and masks it
    secure_aggregation: bool = False
    secagg_clip: float = 2.0
    secagg_bits: int = 22
    #: how long the hub waits for the members at each step of the protocol before it goes on
    #: without those who did not answer
    secagg_phase_s: float = 30.0

    @property
    def central(self) -> bool:
        return self.dp == "central"


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: ModelSpec
    train: TrainSpec = field(default_factory=TrainSpec)
    data: DataSpec = field(default_factory=DataSpec)
    aggregation: AggregationSpec = field(default_factory=AggregationSpec)
    #: as the owner wrote it, except that both tolerances include communication.tolerance
    verification: VerificationSpec = field(default_factory=VerificationSpec)
    communication: CommunicationSpec = field(default_factory=CommunicationSpec)
    privacy: PrivacySpec = field(default_factory=PrivacySpec)
    #: None: data-parallel (every node holds the whole model)
    pipeline: PipelineSpec | None = None


# ---------------------------------------------------------------------------


class _Section:
    def __init__(self, table: object, name: str) -> None:
        if not isinstance(table, Mapping):
            raise SpecError(f"{name}: expected a [{name}] table, got {type(table).__name__}")
        self.table: Mapping[str, Any] = table
        self.name = name
        self.used: set[str] = set()

    def _value(self, key: str, default: object) -> object:
        self.used.add(key)
        return self.table.get(key, default)

    def get_int(self, key: str, default: int, lo: int, hi: int) -> int:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise SpecError(f"{self.name}.{key}: expected an integer {lo}..{hi}, got {_short(value)}")
        return value

    def get_float(
        self, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
    ) -> float:
        value = self._value(key, default)
        bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{self.name}.{key}: expected a number in {bounds}, got {_short(value)}")
        number = float(value)
        ok = (math.isfinite(number) and (lo < number if lo_open else lo <= number)
              and (number < hi if hi_open else number <= hi))
        if not ok:
            raise SpecError(f"{self.name}.{key}: expected a number in {bounds}, got {number}")
        return number

    def get_choice(self, key: str, default: str, allowed: Sequence[str]) -> str:
        value = self._value(key, default)
        if not isinstance(value, str) or value not in allowed:
            raise SpecError(f"{self.name}.{key}: expected one of {', '.join(allowed)}, got {_short(value)}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self.name}.{key}: expected true or false, got {_short(value)}")
        return value

    def get_text(self, key: str, default: str | None, max_len: int = 128) -> str:
        value = self._value(key, default)
        if value is None:
            raise SpecError(f"{self.name}.{key}: required")
        if not isinstance(value, str) or not 1 <= len(value) <= max_len or not value.isprintable():
            raise SpecError(f"{self.name}.{key}: expected text of 1..{max_len} printable characters, got {_short(value)}")
        return value

    def finish(self) -> None:
        for key in self.table:
            if key not in self.used:
                raise SpecError(
                    f"{self.name}.{_short(key)}: unknown key; allowed: {', '.join(sorted(self.used))}"
                )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _train(s: _Section, task: str) -> TrainSpec:
    d = TrainSpec()  # the defaults live in the dataclass only
    spec = TrainSpec(
        rounds=s.get_int("rounds", d.rounds, 1, 1_000_000),
        local_epochs=s.get_int("local_epochs", d.local_epochs, 1, 1000),
        local_steps=s.get_int("local_steps", d.local_steps, 0, 1 << 30),
        batch_size=s.get_int("batch_size", d.batch_size, 1, 1 << 20),
        optimizer=s.get_choice("optimizer", d.optimizer, OPTIMIZERS),
        lr=s.get_float("lr", d.lr, 0.0, 100.0, lo_open=True),
        momentum=s.get_float("momentum", d.momentum, 0.0, 0.999),
        weight_decay=s.get_float("weight_decay", d.weight_decay, 0.0, 10.0),
        beta1=s.get_float("beta1", d.beta1, 0.0, 0.9999),
        beta2=s.get_float("beta2", d.beta2, 0.0, 0.99999),
        loss=s.get_choice("loss", "mse" if task == "regression" else "cross_entropy", LOSSES),
        seed=s.get_int("seed", d.seed, 0, MAX_SEED),
        grad_clip=s.get_float("grad_clip", d.grad_clip, 0.0, 1e6),
        round_target_s=s.get_float("round_target_s", d.round_target_s, 0.0, 86_400.0, lo_open=True),
        deadline_slack=s.get_float("deadline_slack", d.deadline_slack, 1.0, 100.0),
        precision=s.get_choice("precision", d.precision, JOB_PRECISIONS),
        lr_scaling=s.get_choice("lr_scaling", d.lr_scaling, LR_SCALINGS),
        lr_scale_max=s.get_float("lr_scale_max", d.lr_scale_max, 1.0, 1024.0),
    )
    if spec.lr_scaling != "none" and spec.local_steps:
        raise SpecError("train.lr_scaling: a round of local_steps trains the same steps on any shard;"
                        " scale the learning rate with shards of epochs (local_steps = 0)")
    if task == "classification" and spec.loss != "cross_entropy":
        raise SpecError("train.loss: a classification model trains with cross_entropy")
    if task == "regression" and spec.loss != "mse":
        raise SpecError("train.loss: a regression model trains with mse")
    if task == "language_model" and spec.loss != "cross_entropy":
        raise SpecError("train.loss: a language_model trains with cross_entropy (on the next token)")
    return spec


def _data(s: _Section) -> DataSpec:
    d = DataSpec()  # the defaults live in the dataclass only
    spec = DataSpec(
        chunk_size=s.get_int("chunk_size", 0, 1, 1_000_000) if "chunk_size" in s.table else d.chunk_size,
        split=s.get_choice("split", d.split, SPLITS),
        validation_fraction=s.get_float("validation_fraction", 0.0, 0.0, 0.9)
        if "validation_fraction" in s.table else d.validation_fraction,
        label_column=s.get_text("label_column", d.label_column, 64),
        source=s.get_choice("source", d.source, DATA_SOURCES),
        min_samples=s.get_int("min_samples", d.min_samples, 1, MAX_SILO_SAMPLES),
        max_samples=s.get_int("max_samples", d.max_samples, 1, MAX_SILO_SAMPLES),
        label_histogram=s.get_bool("label_histogram", d.label_histogram),
        quorum=s.get_int("quorum", d.quorum, 1, 100_000),
        round_deadline_s=s.get_float("round_deadline_s", d.round_deadline_s, 0.0, 7 * 86_400.0, lo_open=True),
        late=s.get_choice("late", d.late, LATE),
    )
    if spec.max_samples < spec.min_samples:
        raise SpecError(f"data.max_samples: must be at least min_samples ({spec.min_samples}), got {spec.max_samples}")
    if not spec.node_local:
        for key in SILO_KEYS:
            if key in s.table:
                raise SpecError(f"data.{key}: only for source = \"node-local\"")
    elif "validation_fraction" in s.table or "chunk_size" in s.table or "split" in s.table:
        raise SpecError("data.source: a node-local job has no training set at the hub to chunk, split or hold out from")
    return spec


def _node_local_verification(s: _Section, spec: VerificationSpec) -> VerificationSpec:
    """Node-local data: every silo is different, so nothing can be replicated, and the hub has no
    rows to re-execute a segment on. Replication and spot checks are off (asking for them is an
    error); the round's scores, the norm bound and the aggregation rule still apply."""
    for key in ("replication", "spot_check", "spot_check_trusted"):
        if key in s.table and s.table[key] not in (0, 0.0):
            raise SpecError(f"verification.{key}: a node-local job cannot be replicated or re-executed "
                            "(each silo's data exists on one node only); leave it out or set 0")
    return dataclasses.replace(spec, replication=0.0, spot_check=0.0, spot_check_trusted=0.0)


def _aggregation(s: _Section) -> AggregationSpec:
    d = AggregationSpec()  # the defaults live in the dataclass only
    spec = AggregationSpec(
        method=s.get_choice("method", d.method, METHODS),
        trim_beta=s.get_float("trim_beta", d.trim_beta, 0.0, 0.49),
        krum_f=s.get_int("krum_f", d.krum_f, 0, 10_000),
        krum_m=s.get_int("krum_m", d.krum_m, 1, 10_000),
        clip_norm=s.get_float("clip_norm", d.clip_norm, 0.0, 1e12),
        server_optimizer=s.get_choice("server_optimizer", d.server_optimizer, SERVER_OPTIMIZERS),
        server_lr=s.get_float("server_lr", d.server_lr, 0.0, 100.0, lo_open=True),
        server_momentum=s.get_float("server_momentum", d.server_momentum, 0.0, 0.999),
        server_beta1=s.get_float("server_beta1", d.server_beta1, 0.0, 0.9999),
        server_beta2=s.get_float("server_beta2", d.server_beta2, 0.0, 0.99999),
        server_eps=s.get_float("server_eps", d.server_eps, 0.0, 1.0, lo_open=True),
    )
    return spec


def derived_strategy(aggregation: AggregationSpec, privacy: PrivacySpec) -> str:
    """The strategy a spec's fields mean: secure aggregation or central DP when [privacy] asks for
    it, FedAvgM or FedAdam for FedAvg with that server optimizer, else the [aggregation] method."""
    if privacy.secure_aggregation:
        return "secure_aggregation"
    if privacy.central:
        return "central_dp"
    if aggregation.method == "fedavg" and aggregation.server_optimizer in ("fedavgm", "fedadam"):
        return aggregation.server_optimizer
    return aggregation.method


def strategy_of(spec: JobSpec) -> str:
    """The aggregation strategy a job uses: the one it names, else the one its fields mean."""
    return spec.aggregation.strategy or derived_strategy(spec.aggregation, spec.privacy)


def _strategy(s: _Section, aggregation: AggregationSpec, privacy: PrivacySpec) -> AggregationSpec:
    """[aggregation] strategy, optional: a name the other fields mean must be the one they mean
    (a spec says one thing), and under [privacy] no other strategy may stand in for the one that
    keeps its promise."""
    if "strategy" not in s.table:
        s.used.add("strategy")
        return aggregation
    name = s.get_text("strategy", None, max_len=48)
    if STRATEGY_NAME.fullmatch(name) is None:
        raise SpecError(f"aggregation.strategy: expected a name of lowercase letters, digits and _, got {_short(name)}")
    derived = derived_strategy(aggregation, privacy)
    if (name in DERIVED_STRATEGIES or privacy.central or privacy.secure_aggregation) and name != derived:
        raise SpecError(f"aggregation.strategy: this spec's fields mean {derived!r}, not {name!r}; "
                        "leave strategy out, or change the fields that choose it")
    return dataclasses.replace(aggregation, strategy=name)


def _verification(s: _Section) -> VerificationSpec:
    d = VerificationSpec()  # the defaults live in the dataclass only
    s.used.add("replication")
    raw = s.table.get("replication", d.replication)
    replication: str | float
    if raw == "adaptive":
        replication = "adaptive"
    elif not isinstance(raw, bool) and isinstance(raw, (int, float)) and math.isfinite(raw) and 0.0 <= raw <= 1.0:
        replication = float(raw)
    else:
        raise SpecError(
            f"verification.replication: expected \"adaptive\" or a number in [0, 1], got {_short(raw)}"
        )
    quorum = s.get_int("quorum", d.quorum, 2, 16)
    max_replicas = s.get_int("max_replicas", d.max_replicas, 2, 32)
    if max_replicas < quorum:
        raise SpecError(f"verification.max_replicas: must be at least quorum ({quorum}), got {max_replicas}")
    tolerance = s.get_float("tolerance", d.tolerance, 0.0, 1.0, lo_open=True)
    cross = s.get_float("cross_class_tolerance", d.cross_class_tolerance, 0.0, 10.0, lo_open=True)
    if cross < tolerance:
        raise SpecError(f"verification.cross_class_tolerance: must be at least tolerance ({tolerance:g}), got {cross:g}")
    return VerificationSpec(
        replication=replication,
        quorum=quorum,
        max_replicas=max_replicas,
        tolerance=tolerance,
        trust_after=s.get_int("trust_after", d.trust_after, 0, 1_000_000),
        cosine_min=s.get_float("cosine_min", d.cosine_min, -1.0, 1.0),
        norm_ratio_max=s.get_float("norm_ratio_max", d.norm_ratio_max, 1.0, 1e6),
        free_rider_norm=s.get_float("free_rider_norm", d.free_rider_norm, 0.0, 1.0),
        replica_wait_s=s.get_float("replica_wait_s", d.replica_wait_s, 0.0, 86_400.0, lo_open=True),
        cross_class_tolerance=cross,
        unverified=s.get_choice("unverified", d.unverified, UNVERIFIED),
        norm_bound=_norm_bound(s.get_float("norm_bound", d.norm_bound, 0.0, 1e6)),
        untrusted_share=s.get_float("untrusted_share", d.untrusted_share, 0.0, 1.0, lo_open=True),
        checkpoint_every=s.get_int("checkpoint_every", d.checkpoint_every, 0, 1 << 30),
        spot_check=s.get_float("spot_check", d.spot_check, 0.0, 1.0),
        spot_check_trusted=s.get_float("spot_check_trusted", d.spot_check_trusted, 0.0, 1.0),
        spot_check_stale_s=s.get_float("spot_check_stale_s", d.spot_check_stale_s, 0.0, 1e9),
        segment_tolerance=s.get_float("segment_tolerance", d.segment_tolerance, 0.0, 10.0, lo_open=True),
        segment_tolerance_low=s.get_float("segment_tolerance_low", d.segment_tolerance_low, 0.0, 10.0,
                                          lo_open=True),
        state_wait_s=s.get_float("state_wait_s", d.state_wait_s, 0.0, 86_400.0, lo_open=True),
        trend_rounds=s.get_int("trend_rounds", d.trend_rounds, 0, 1_000_000),
        trend_cosine_min=s.get_float("trend_cosine_min", d.trend_cosine_min, -1.0, 1.0),
        keep_rounds=_keep_rounds(s.get_int("keep_rounds", d.keep_rounds, 0, 1_000_000),
                                 s.get_int("trend_rounds", d.trend_rounds, 0, 1_000_000)),
        auto_rollback=s.get_bool("auto_rollback", d.auto_rollback),
    )


def _keep_rounds(keep: int, trend_rounds: int) -> int:
    """``keep_rounds``: 0 (every round's model) or more rounds than the trend audit looks back and
    than a straggler carried into the next round trains from (its models must still be there)."""
    least = max(trend_rounds + 1, 3)
    if 0 < keep < least:
        raise SpecError(f"verification.keep_rounds: must be 0 (keep every round) or at least {least}"
                        f" (more than trend_rounds), got {keep}")
    return keep


def _communication(s: _Section, model: ModelSpec) -> CommunicationSpec:
    d = CommunicationSpec()  # the defaults live in the dataclass only
    update = s.get_choice("update", d.update, ENCODINGS)
    feedback = s.get_bool("error_feedback", update in ("topk", "sign"))
    spec = CommunicationSpec(
        update=update,
        topk_fraction=s.get_float("topk_fraction", d.topk_fraction, 0.0, 1.0, lo_open=True),
        error_feedback=feedback,
        tolerance=s.get_float("tolerance", default_tolerance(update, feedback), 0.0, 10.0),
        download=s.get_choice("download", d.download, DOWNLOADS),
        download_fraction=s.get_float("download_fraction", d.download_fraction, 0.0, 1.0, lo_open=True),
    )
    try:
        spec.encoding.wire_manifest(manifest(model))
    except TensorError as exc:
        raise SpecError(f"communication.update: {exc}") from None
    return spec


def _secure_aggregation(s: _Section, data: DataSpec, aggregation: AggregationSpec,
                        communication: CommunicationSpec) -> PrivacySpec:
    """[privacy] secure_aggregation and its keys: only over silos (quorum >= 3: with two, each
    learns the other's update from the sum), FedAvg (the hub never sees an update to judge or
    sort), fp32 updates without error feedback (the node quantizes them itself)."""
    d = PrivacySpec()
    on = s.get_bool("secure_aggregation", d.secure_aggregation)
    if not on:
        for key in SECAGG_KEYS:
            if key in s.table:
                raise SpecError(f"privacy.{key}: only with secure_aggregation = true")
        s.used.update(SECAGG_KEYS)
        return d
    bits = s.get_int("secagg_bits", d.secagg_bits, 1, 31)
    out = PrivacySpec(
        secure_aggregation=True,
        secagg_clip=s.get_float("secagg_clip", d.secagg_clip, 1.0, 1e6),
        secagg_bits=bits,
        secagg_phase_s=s.get_float("secagg_phase_s", d.secagg_phase_s, 0.0, 86_400.0, lo_open=True),
    )
    if not data.node_local:
        raise SpecError("privacy.secure_aggregation: for [data] source = \"node-local\" jobs")
    if data.quorum < 3:
        raise SpecError("privacy.secure_aggregation: needs [data] quorum >= 3 (with two silos, each learns the "
                        "other's update from the sum)")
    if data.quorum * ((1 << bits) - 1) >= 1 << 32 or data.quorum > 4096:
        raise SpecError(f"privacy.secagg_bits: {data.quorum} silos of {bits} bits could overflow the 32-bit sum; "
                        "lower secagg_bits or the quorum")
    if aggregation.method != "fedavg" or aggregation.clip_norm != 0.0:
        raise SpecError("privacy.secure_aggregation: the hub sees only the sum, so [aggregation] must be "
                        "method = \"fedavg\" without clip_norm")
    if communication.update != "fp32" or communication.error_feedback:
        raise SpecError("privacy.secure_aggregation: updates are quantized by the node; leave "
                        "[communication] update = \"fp32\" without error_feedback")
    if data.late != "drop":
        raise SpecError("data.late: a masked update belongs to its round's roster; with secure_aggregation "
                        "a late update is dropped (late = \"drop\")")
    return out


def _privacy(s: _Section, data: DataSpec, aggregation: AggregationSpec,
             communication: CommunicationSpec | None = None) -> PrivacySpec:
    """[privacy]: its keys other than ``dp`` only with dp on; central DP only over silos (a hub
    job's rows are at the hub: protecting them from the hub's own model is not what this does),
    only with FedAvg (the noise is calibrated to a mean of clipped updates) and with no second
    clip in [aggregation] (the privacy clip replaces it)."""
    d = PrivacySpec()  # the defaults live in the dataclass only
    secagg = _secure_aggregation(s, data, aggregation, communication or CommunicationSpec())
    dp = s.get_choice("dp", d.dp, DP_MODES)
    if dp == "off":
        for key in PRIVACY_KEYS:
            if key in s.table:
                raise SpecError(f"privacy.{key}: only with dp = \"central\"")
        s.used.update(PRIVACY_KEYS)  # an unknown key is still named as one (finish)
        return secagg
    if secagg.secure_aggregation:
        raise SpecError("privacy.dp: central DP clips each update at the hub, which secure aggregation "
                        "hides; not both in this release")
    spec = PrivacySpec(
        dp=dp,
        clip_norm=s.get_float("clip_norm", d.clip_norm, 0.0, 1e12, lo_open=True),
        noise_multiplier=s.get_float("noise_multiplier", d.noise_multiplier, 0.0, 1e6),
        delta=s.get_float("delta", d.delta, 0.0, 1.0, lo_open=True, hi_open=True),
    )
    if not data.node_local:
        raise SpecError("privacy.dp: central differential privacy is for [data] source = \"node-local\" jobs")
    if aggregation.method != "fedavg":
        raise SpecError(f"privacy.dp: central differential privacy averages with fedavg, not {aggregation.method}"
                        " (set [aggregation] method = \"fedavg\")")
    if aggregation.clip_norm != 0.0:
        raise SpecError("aggregation.clip_norm: [privacy] clip_norm replaces it under dp = \"central\";"
                        " leave it out or set 0")
    return spec


def _norm_bound(value: float) -> float:
    if 0.0 < value < 1.0:
        raise SpecError(f"verification.norm_bound: 0 (off) or at least 1, got {value:g}")
    return value


SECTIONS: Final = ("job", "model", "train", "data", "aggregation", "verification", "communication", "privacy",
                   "pipeline")


def parse_job_spec(text: str | bytes) -> JobSpec:
    """Parse and validate a job spec TOML document."""
    if isinstance(text, (bytes, bytearray)):
        if len(text) > MAX_SPEC_BYTES:
            raise SpecError(f"job spec is larger than {MAX_SPEC_BYTES} bytes")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError("job spec is not UTF-8 text") from None
    if not isinstance(text, str):
        raise SpecError(f"job spec must be TOML text, got {type(text).__name__}")
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"job spec is larger than {MAX_SPEC_BYTES} bytes")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"job spec is not valid TOML: {exc}") from None
    for key in doc:
        if key not in SECTIONS:
            raise SpecError(f"{_short(key)}: unknown section; allowed: {', '.join(SECTIONS)}")
    if "job" not in doc:
        raise SpecError("job.name: required (add a [job] section with name = \"...\")")
    if "model" not in doc:
        raise SpecError("model.kind: required (add a [model] section; kind = mlp, cnn, sequential or transformer)")
    job = _Section(doc["job"], "job")
    name = job.get_text("name", None)
    job.finish()
    model = ModelSpec.from_dict(without_lora(_Section(doc["model"], "model").table), where="model")
    sections: dict[str, _Section] = {
        key: _Section(doc.get(key, {}), key)
        for key in ("train", "data", "aggregation", "verification", "communication", "privacy")
    }
    train = _train(sections["train"], model.task)
    model = apply_finetune(sections["train"].table, sections["train"].used, model)
    data = _data(sections["data"])
    if data.node_local and train.lr_scaling != "none":
        raise SpecError("train.lr_scaling: a node-local job's silos are not shards of one round's data;"
                        " leave it \"none\"")
    aggregation = _aggregation(sections["aggregation"])
    verification = _verification(sections["verification"])
    if data.node_local:
        verification = _node_local_verification(sections["verification"], verification)
    communication = _communication(sections["communication"], model)
    privacy = _privacy(sections["privacy"], data, aggregation, communication)
    aggregation = _strategy(sections["aggregation"], aggregation, privacy)
    pipeline = None
    if "pipeline" in doc:
        pipeline_section = _Section(doc["pipeline"], "pipeline")
        pipeline = parse_pipeline(pipeline_section, model, train, data, privacy)
        pipeline_section.finish()
    check_finetune(model, secure_aggregation=privacy.secure_aggregation)
    for section in sections.values():
        section.finish()
    if communication.tolerance:
        verification = dataclasses.replace(
            verification, tolerance=verification.tolerance + communication.tolerance,
            cross_class_tolerance=verification.cross_class_tolerance + communication.tolerance)
    return JobSpec(name, model, train, data, aggregation, verification, communication, privacy, pipeline)


def load_job_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and parse a job spec file."""
    target = Path(path)
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise SpecError(f"cannot read job spec {target}: {exc.strerror}") from None
    return parse_job_spec(data)


__all__ = [
    "AggregationSpec",
    "CommunicationSpec",
    "DataSpec",
    "JobSpec",
    "PipelineSpec",
    "PrivacySpec",
    "TrainSpec",
    "VerificationSpec",
    "derived_strategy",
    "load_job_spec",
    "parse_job_spec",
    "strategy_of",
]
