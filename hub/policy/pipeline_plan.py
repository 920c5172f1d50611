"""The pipeline planner: which contiguous units each stage runs, on which node, with how many
micro-batches and which schedule, so that one training step takes the least predicted time
while no node holds more than the memory it offers.

Functional core: measured unit costs (protocol/modelanalysis.py) and the nodes' offers in, a
frozen `Plan` or a one-line `Refusal` out. No clock, no I/O, no torch; docs/pipeline.md
describes the memory and time model. The search is PipeDream's dynamic programme over
contiguous units, run from the last stage to the first (a stage's activations in flight under
1F1B depend on how many stages follow it, so one pass serves every stage count), over groups of
identical nodes rather than node ids (interchangeable nodes are not permuted), with a Pareto set
per state and branch-and-bound against the best complete pipeline. It is exact for any node set
whose groups of identical offers allow at most `MAX_STATES` combinations (every set of up to
`MAX_EXACT_NODES` nodes); beyond that each pipeline is planned on the `MAX_EXACT_NODES` fastest
nodes (or, when those cannot hold the model, the ones offering the most memory), so its cost
stays bounded.

When more nodes are online than one pipeline needs, the planner plans further pipelines on the
nodes left (data-parallel replicas that train different shards and merge each step): for each
cap on the stages a replica count allows, it adds pipelines for as long as each one raises the
samples trained per second, and keeps the cap that trains the most.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from gpuflex.protocol.modelanalysis import UnitCost

SCHEDULES: Final = ("gpipe", "1f1b")
DEFAULT_MICRO_BATCHES: Final = (1, 2, 4, 8, 16, 32)
#: every node set this small is planned exactly
MAX_EXACT_NODES: Final = 8
#: the most combinations of nodes (counts per group of identical offers) an exact search walks
MAX_STATES: Final = 1 << MAX_EXACT_NODES
#: the optimizer step's cost per byte of a stage's state (parameters, gradients, optimizer state):
#: one elementwise pass, about two FLOPs per four-byte element
UPDATE_FLOPS_PER_BYTE: Final = 0.5


@dataclass(frozen=True)
class NodeOffer:
    """What an online node offers a pipeline: its memory budget (``--max-memory``), its measured
    training speed (effective FLOP/s) and its measured link to the hub.

    Two optional measurements refine its times: ``unit_overhead_s``, the fixed time a unit's
    forward and backward take per micro-batch whatever its size (kernel launches, the framework's
    per-op cost: it dominates small micro-batches), and ``update_bytes_per_s``, the bytes of
    state its optimizer step updates per second (an elementwise pass is bound by memory, not
    FLOPs). Without them (0), a unit costs only its FLOPs and the update `UPDATE_FLOPS_PER_BYTE`."""

    node_id: str
    memory_bytes: int
    flops_per_s: float
    bandwidth_bytes_per_s: float
    rtt_s: float
    unit_overhead_s: float = 0.0
    update_bytes_per_s: float = 0.0


@dataclass(frozen=True)
class Stage:
    """One stage: units ``first_unit`` up to ``end_unit`` (exclusive) on ``node_id``. Times are
    per micro-batch: ``compute_s`` forward and backward, ``transfer_s`` what the node sends
    (activations forward, gradients back through the hub's relay); ``update_s`` the optimizer step."""

    first_unit: int
    end_unit: int
    node_id: str
    memory_bytes: int
    compute_s: float
    transfer_s: float
    update_s: float

    @property
    def micro_batch_s(self) -> float:
        return self.compute_s + self.transfer_s


@dataclass(frozen=True)
class Pipeline:
    """One pipeline: its stages in order, the micro-batches a step is cut into (of at most
    ``micro_batch_size`` samples), the schedule, and its predicted step time and bubble."""

    stages: tuple[Stage, ...]
    micro_batches: int
    micro_batch_size: int
    schedule: str
    step_s: float
    bubble_fraction: float


@dataclass(frozen=True)
class Plan:
    """The planner's choice: one pipeline, or several replicas of the model's pipeline, each
    training ``batch_size`` samples a step on its own shard; a step ends when the slowest does."""

    pipelines: tuple[Pipeline, ...]
    batch_size: int
    step_s: float

    @property
    def replicas(self) -> int:
        return len(self.pipelines)

    @property
    def samples_per_s(self) -> float:
        return self.replicas * self.batch_size / self.step_s if self.step_s > 0 else math.inf


@dataclass(frozen=True)
class Refusal:
    """No pipeline fits the nodes online; ``reason`` is one line a person can act on."""

    reason: str


class _Model:
    """Prefix sums over the units, and the cost formulas every part of the planner shares."""

    def __init__(self, units: Sequence[UnitCost], batch_size: int) -> None:
        self.units = tuple(units)
        self.batch_size = batch_size
        self.state = _prefix(u.state_bytes for u in units)
        self.saved = _prefix(u.saved_bytes for u in units)
        self.flops = _prefix(u.flops for u in units)
        self.output = [u.output_bytes for u in units]

    def memory(self, i: int, j: int, in_flight: int, b: int) -> int:
        """Units [i, j) hold their state all step and, per micro-batch in flight, what they
        saved for backward and the stage's output (held until its gradient comes back)."""
        per_micro = b * (self.saved[j] - self.saved[i] + self.output[j - 1])
        return int(self.state[j] - self.state[i] + in_flight * per_micro)

    def compute_s(self, i: int, j: int, node: NodeOffer, b: int) -> float:
        return (
            b * (self.flops[j] - self.flops[i]) / node.flops_per_s + (j - i) * node.unit_overhead_s
        )

    def update_s(self, i: int, j: int, node: NodeOffer) -> float:
        state = self.state[j] - self.state[i]
        if node.update_bytes_per_s > 0:
            return state / node.update_bytes_per_s
        return state * UPDATE_FLOPS_PER_BYTE / node.flops_per_s

    def boundary_s(self, j: int, sender: NodeOffer, receiver: NodeOffer, b: int) -> float:
        """One micro-batch's tensor across the cut before unit ``j``, relayed by the hub: up the
        sender's link and down the receiver's, each at the slower link's rate, plus both round trips."""
        rate = min(sender.bandwidth_bytes_per_s, receiver.bandwidth_bytes_per_s)
        return 2.0 * b * self.output[j - 1] / rate + sender.rtt_s + receiver.rtt_s


def in_flight(schedule: str, micro_batches: int, stages_from_here: int) -> int:
    """Micro-batches whose activations a stage holds at once: all of them under GPipe (every
    forward before any backward); under 1F1B at most the stages from this one to the last."""
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages_from_here)


def bubble_fraction(micro_batches: int, stages: int) -> float:
    """The share of a step a stage idles while the pipeline fills and drains (GPipe and 1F1B alike)."""
    return (stages - 1) / (micro_batches + stages - 1)


def evaluate_pipeline(
    units: Sequence[UnitCost],
    nodes: Sequence[NodeOffer],
    ends: Sequence[int],
    *,
    micro_batches: int,
    schedule: str,
    batch_size: int,
) -> Pipeline | None:
    """The predicted `Pipeline` of one given assignment: stage s runs units ``ends[s-1]`` up to
    ``ends[s]`` (the first from 0; the last end must be ``len(units)``) on ``nodes[s]``. None
    when a stage does not fit its node's memory. The planner's search ranks by the same numbers."""
    model = _Model(units, batch_size)
    b = math.ceil(batch_size / micro_batches)
    count = len(ends)
    starts = (0, *ends[:-1])
    stages = []
    for s, (i, j, node) in enumerate(zip(starts, ends, nodes, strict=True)):
        memory = model.memory(i, j, in_flight(schedule, micro_batches, count - s), b)
        if memory > node.memory_bytes:
            return None
        transfer = 0.0
        if s + 1 < count:
            transfer += model.boundary_s(j, node, nodes[s + 1], b)
        if s > 0:
            transfer += model.boundary_s(i, node, nodes[s - 1], b)
        stages.append(
            Stage(
                first_unit=i,
                end_unit=j,
                node_id=node.node_id,
                memory_bytes=memory,
                compute_s=model.compute_s(i, j, node, b),
                transfer_s=transfer,
                update_s=model.update_s(i, j, node),
            )
        )
    return _pipeline(tuple(stages), micro_batches, b, schedule)


def step_s(times: Sequence[float], m: int, update_s: float) -> float:
    """A step of ``m`` micro-batches through stages of micro-batch ``times``: the first
    micro-batch crosses every stage once (their sum), the other m - 1 follow at the slowest
    stage's pace, then the slowest optimizer step. (A flow shop of identical jobs; with equal
    stages it is (m + S - 1) slots of one stage.)"""
    return sum(times) + (m - 1) * max(times) + update_s


def _pipeline(stages: tuple[Stage, ...], m: int, b: int, schedule: str) -> Pipeline:
    """The step of `step_s` over the stages' micro-batch times."""
    step = step_s([s.micro_batch_s for s in stages], m, max(s.update_s for s in stages))
    return Pipeline(
        stages=stages,
        micro_batches=m,
        micro_batch_size=b,
        schedule=schedule,
        step_s=step,
        bubble_fraction=bubble_fraction(m, len(stages)),
    )


def plan_pipelines(
    units: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    *,
    batch_size: int,
    micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
    schedules: Sequence[str] = SCHEDULES,
    max_replicas: int | None = None,
) -> Plan | Refusal:
    """The fastest plan for ``units`` on ``offers`` (see the module's docstring), or a `Refusal`
    saying why none fits. ``max_replicas``: at most this many pipelines (None: as many as help).

    ValueError for a call no job could make (no units, a batch size below 1, no micro-batch
    count at most the batch size, an unknown schedule, an offer with speed or bandwidth <= 0)."""
    _check(units, offers, batch_size, micro_batches, schedules)
    if not offers:
        return Refusal("no node is online to run the pipeline")
    chosen: list[Pipeline] = []
    for cap in _stage_caps(len(offers), len(units), max_replicas):
        pipelines = _replicate(
            units, offers, batch_size, micro_batches, schedules, cap, max_replicas
        )
        if pipelines and (not chosen or _throughput(pipelines) > _throughput(chosen)):
            chosen = pipelines
    if not chosen:
        return Refusal(_refusal(units, offers, batch_size, micro_batches, schedules))
    return Plan(
        pipelines=tuple(chosen), batch_size=batch_size, step_s=max(p.step_s for p in chosen)
    )


def _stage_caps(nodes: int, units: int, max_replicas: int | None) -> list[int]:
    """The most stages a pipeline may have, one value per number of replicas the nodes could
    make (all nodes in one pipeline, shared by two, by three...), largest first."""
    replicas = range(1, (max_replicas or nodes) + 1)
    return sorted({min(units, nodes // k) for k in replicas if nodes // k >= 1}, reverse=True)


def _replicate(
    units: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    batch_size: int,
    micro_batches: Sequence[int],
    schedules: Sequence[str],
    max_stages: int,
    max_replicas: int | None,
) -> list[Pipeline]:
    """Pipelines of at most ``max_stages`` stages, each the fastest on the nodes the ones before
    left, for as long as each raises the samples trained per second."""
    pipelines: list[Pipeline] = []
    left = list(offers)
    while left and (max_replicas is None or len(pipelines) < max_replicas):
        pool = _candidates(left, max_stages)
        best = _best_pipeline(units, pool, batch_size, micro_batches, schedules, max_stages)
        if best is None and len(pool) < len(
            left
        ):  # the fastest nodes cannot hold it: the roomiest may
            roomy = _candidates(left, max_stages, roomiest=True)
            best = _best_pipeline(units, roomy, batch_size, micro_batches, schedules, max_stages)
        if best is None or (
            pipelines and _throughput([*pipelines, best]) <= _throughput(pipelines)
        ):
            break
        pipelines.append(best)
        used = {s.node_id for s in best.stages}
        left = [o for o in left if o.node_id not in used]
    return pipelines


def _throughput(pipelines: Sequence[Pipeline]) -> float:
    return len(pipelines) / max(p.step_s for p in pipelines)


def _check(
    units: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    batch_size: int,
    micro_batches: Sequence[int],
    schedules: Sequence[str],
) -> None:
    if not units:
        raise ValueError("the model has no units to plan")
    if batch_size < 1:
        raise ValueError(f"batch size {batch_size}: must be >= 1")
    if not any(1 <= m <= batch_size for m in micro_batches):
        raise ValueError(f"micro-batch counts {tuple(micro_batches)}: none is in [1, {batch_size}]")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"schedules {tuple(schedules)}: expected some of {', '.join(SCHEDULES)}")
    ids = [o.node_id for o in offers]
    if len(set(ids)) != len(ids):
        raise ValueError("two offers name the same node")
    for o in offers:
        if not (
            o.flops_per_s > 0
            and o.bandwidth_bytes_per_s > 0
            and o.rtt_s >= 0
            and o.memory_bytes >= 0
            and o.unit_overhead_s >= 0
            and o.update_bytes_per_s >= 0
        ):
            raise ValueError(
                f"node {o.node_id}: speed and bandwidth must be > 0; round trip, memory,"
                " unit overhead and update rate >= 0"
            )


def _candidates(
    offers: Sequence[NodeOffer], max_stages: int, *, roomiest: bool = False
) -> list[NodeOffer]:
    """The nodes one pipeline search considers: at most ``max_stages`` of each kind of offer and,
    when the groups of identical offers would make more than `MAX_STATES` combinations, the
    `MAX_EXACT_NODES` fastest nodes (``roomiest``: those offering the most memory)."""
    groups: dict[tuple[int, float, float, float, float, float], list[NodeOffer]] = {}
    for o in sorted(offers, key=lambda o: o.node_id):
        groups.setdefault(_kind(o), []).append(o)
    kept = [o for members in groups.values() for o in members[:max_stages]]
    if math.prod(min(len(g), max_stages) + 1 for g in groups.values()) <= MAX_STATES:
        return kept
    if roomiest:
        kept.sort(key=lambda o: (-o.memory_bytes, -o.flops_per_s, o.node_id))
    else:
        kept.sort(
            key=lambda o: (
                -o.flops_per_s,
                -o.memory_bytes,
                -o.bandwidth_bytes_per_s,
                o.rtt_s,
                o.node_id,
            )
        )
    return kept[:MAX_EXACT_NODES]


def _kind(o: NodeOffer) -> tuple[int, float, float, float, float, float]:
    return (
        o.memory_bytes,
        o.flops_per_s,
        o.bandwidth_bytes_per_s,
        o.rtt_s,
        o.unit_overhead_s,
        o.update_bytes_per_s,
    )


def _best_pipeline(
    units: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    batch_size: int,
    micro_batches: Sequence[int],
    schedules: Sequence[str],
    max_stages: int,
) -> Pipeline | None:
    """The fastest single pipeline of at most ``max_stages`` stages over every micro-batch count
    and schedule (ties: the schedule listed first, then fewer micro-batches)."""
    if not offers:
        return None
    model = _Model(units, batch_size)
    kinds = sorted({_kind(o) for o in offers})
    members = [[o for o in offers if _kind(o) == k] for k in kinds]
    best: Pipeline | None = None
    if len(kinds) > 2:  # a plan on the stronger half of the node kinds bounds the search from above
        half = {k for k in sorted(kinds, key=lambda k: (-k[1], -k[0]))[: len(kinds) // 2]}
        best = _best_pipeline(
            units,
            [o for o in offers if _kind(o) in half],
            batch_size,
            micro_batches,
            schedules,
            max_stages,
        )
    # Both schedules take the same time and 1F1B never holds more, so the search runs under the
    # leaner one; a schedule listed before it is kept where the chosen stages fit it as well.
    lean = "1f1b" if "1f1b" in schedules else schedules[0]
    counts = sorted({m for m in micro_batches if 1 <= m <= batch_size})
    if best is not None:  # near the seed's count first: the best bound early prunes the most
        seed = best.micro_batches
        counts.sort(key=lambda m: abs(math.log2(m / seed)))
    for m in counts:
        bound = best.step_s if best is not None else math.inf
        found = _search(_Search(model, members, m, lean, max_stages), bound)
        if found is not None and (best is None or found.step_s < best.step_s):
            best = found
    if best is None:
        return None
    by_id = {o.node_id: o for o in offers}
    for schedule in schedules[: list(schedules).index(lean)]:
        same = evaluate_pipeline(
            units,
            [by_id[s.node_id] for s in best.stages],
            [s.end_unit for s in best.stages],
            micro_batches=best.micro_batches,
            schedule=schedule,
            batch_size=batch_size,
        )
        if same is not None:
            return same
    return best


@dataclass(frozen=True)
class _Search:
    """One search's fixed terms: the nodes as groups of identical offers, the micro-batch count
    and its size, the schedule, and the most stages a pipeline may have."""

    model: _Model
    members: list[list[NodeOffer]]
    m: int
    schedule: str
    max_stages: int
    #: memo: nodes used per kind -> (memory left, speed left, the kinds with a node left)
    left: dict[tuple[int, ...], tuple[float, float, tuple[int, ...]]] = field(default_factory=dict)
    #: memo: (cut, front stage's kind, nodes used per kind) -> the cheapest send back across the cut
    cuts: dict[tuple[int, int, tuple[int, ...]], float] = field(default_factory=dict)

    @property
    def b(self) -> int:
        return math.ceil(self.model.batch_size / self.m)

    def nodes_left(self, used: tuple[int, ...]) -> tuple[float, float, tuple[int, ...]]:
        found = self.left.get(used)
        if found is None:
            kinds = tuple(
                k for k, (g, n) in enumerate(zip(self.members, used, strict=True)) if n < len(g)
            )
            memory = sum(
                (len(self.members[k]) - used[k]) * self.members[k][0].memory_bytes for k in kinds
            )
            speed = sum(
                (len(self.members[k]) - used[k]) * self.members[k][0].flops_per_s for k in kinds
            )
            found = self.left[used] = (memory, speed, kinds)
        return found

    def cheapest_cut(self, h: int, front: int, used: tuple[int, ...]) -> float:
        key = (h, front, used)
        found = self.cuts.get(key)
        if found is None:
            node, kinds = self.members[front][0], self.nodes_left(used)[2]
            found = min(
                (self.model.boundary_s(h, node, self.members[k][0], self.b) for k in kinds),
                default=math.inf,
            )
            self.cuts[key] = found
        return found


#: a partial pipeline, built from the last stage forwards: (the slowest closed stage's
#: micro-batch time, the front stage's time so far (its backward send is not known yet), the
#: slowest optimizer step, the closed stages' times summed, the stages chosen as (first unit,
#: end unit, kind) from front to back)
_Entry = tuple[float, float, float, float, tuple[tuple[int, int, int], ...]]


def _search(ctx: _Search, bound: float) -> Pipeline | None:
    """The fastest pipeline with ``m`` micro-batches under ``schedule`` whose step beats
    ``bound``, or None. States: (first unit of the front stage, nodes used per kind, the front
    stage's kind) -> the Pareto set of `_Entry`s."""
    model, members, m, schedule, b = ctx.model, ctx.members, ctx.m, ctx.schedule, ctx.b
    n_units = len(model.units)
    offers = [g[0] for g in members]
    start = tuple(0 for _ in members)
    layers: dict[int, dict[tuple[tuple[int, ...], int], list[_Entry]]] = {
        i: {} for i in range(n_units)
    }
    best: tuple[float, tuple[tuple[int, int, int], ...]] | None = None
    for k, node in enumerate(offers):  # the last stage: units [i, n_units)
        for i in range(n_units):
            if model.memory(i, n_units, in_flight(schedule, m, 1), b) <= node.memory_bytes:
                entry: _Entry = (
                    0.0,
                    model.compute_s(i, n_units, node, b),
                    model.update_s(i, n_units, node),
                    0.0,
                    ((i, n_units, k),),
                )
                _add(layers[i], (_bump(start, k), k), entry)
    for i in range(n_units - 1, -1, -1):
        for (used, k), entries in layers[i].items():
            stages = sum(used)
            for entry in entries:
                slowest, front, update, total, chosen = entry
                # exact once the front stage is the first (i == 0); stages in front only add
                lower = total + front + (m - 1) * max(slowest, front) + update
                if lower >= bound or (best is not None and lower >= best[0]):
                    continue
                if i == 0:
                    best = (lower, chosen)
                    continue
                if stages < ctx.max_stages:
                    _extend(
                        ctx,
                        layers,
                        used,
                        k,
                        entry,
                        i,
                        min(bound, best[0]) if best is not None else bound,
                    )
    if best is None:
        return None
    nodes, taken = [], [0 for _ in members]
    for _, _, k in best[1]:
        nodes.append(members[k][taken[k]])
        taken[k] += 1
    return evaluate_pipeline(
        model.units,
        nodes,
        [end for _, end, _ in best[1]],
        micro_batches=m,
        schedule=schedule,
        batch_size=model.batch_size,
    )


def _extend(
    ctx: _Search,
    layers: dict[int, dict[tuple[tuple[int, ...], int], list[_Entry]]],
    used: tuple[int, ...],
    k: int,
    entry: _Entry,
    i: int,
    bound: float,
) -> None:
    """Every stage that can go in front of ``entry``'s front stage (which starts at unit ``i``)
    and keeps the step under ``bound``."""
    model, members, m, schedule, b = ctx.model, ctx.members, ctx.m, ctx.schedule, ctx.b
    slowest, front, update, total, chosen = entry
    after = sum(used)
    receiver = members[k][0]
    for v, group in enumerate(members):
        if used[v] >= len(group):
            continue
        sender, bumped = group[0], _bump(used, v)
        cut = model.boundary_s(i, sender, receiver, b)
        closed, closed_total = max(slowest, front + cut), total + front + cut
        flight = in_flight(schedule, m, after + 1)
        for h in range(i - 1, -1, -1):
            if model.memory(h, i, flight, b) > sender.memory_bytes:
                break  # a longer stage holds at least as much
            new_front = model.compute_s(h, i, sender, b) + cut
            new_update = max(update, model.update_s(h, i, sender))
            if closed_total + new_front + (m - 1) * max(closed, new_front) + new_update >= bound:
                break  # a longer stage is no faster
            if h > 0 and not _may_finish(ctx, bumped, h, v, (closed, new_front, new_update, closed_total), bound):
                continue
            _add(layers[h], (bumped, v), (closed, new_front, new_update, closed_total, ((h, i, v), *chosen)))


def _may_finish(
    ctx: _Search,
    used: tuple[int, ...],
    h: int,
    front_kind: int,
    times: tuple[float, float, float, float],
    bound: float,
) -> bool:
    """Whether units [0, h) could still go on the nodes ``used`` leaves, in a pipeline whose step
    beats ``bound``: their state must fit in the memory left, the front stage still sends a
    gradient back across the cut at ``h``, and no split runs their FLOPs faster than all the
    speed left together (so the stages in front take at least that time in sum, and the slowest
    of them at least that long). ``times``: the entry's (slowest, front, update, closed total)."""
    slowest, front, update, total = times
    stages = sum(used)
    if stages >= ctx.max_stages:
        return False
    memory, speed, _ = ctx.nodes_left(used)
    if speed <= 0 or ctx.model.state[h] > memory:
        return False
    spread = ctx.b * ctx.model.flops[h] / speed
    cut = ctx.cheapest_cut(h, front_kind, used)
    return total + front + cut + spread + (ctx.m - 1) * max(slowest, front + cut, spread) + update < bound


def _bump(used: tuple[int, ...], k: int) -> tuple[int, ...]:
    return (*used[:k], used[k] + 1, *used[k + 1 :])


def _add(
    layer: dict[tuple[tuple[int, ...], int], list[_Entry]],
    key: tuple[tuple[int, ...], int],
    entry: _Entry,
) -> None:
    """Keep ``entry`` in its state's Pareto set unless one there is at least as good in all four
    times; drop those it beats."""
    entries = layer.setdefault(key, [])
    a, b, c, d = entry[0], entry[1], entry[2], entry[3]
    for e in entries:
        if e[0] <= a and e[1] <= b and e[2] <= c and e[3] <= d:
            return
    entries[:] = [e for e in entries if not (a <= e[0] and b <= e[1] and c <= e[2] and d <= e[3])]
    entries.append(entry)


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _refusal(
    units: Sequence[UnitCost],
    offers: Sequence[NodeOffer],
    batch_size: int,
    micro_batches: Sequence[int],
    schedules: Sequence[str],
) -> str:
    """Why no pipeline fits, in one line: a unit no node can hold even alone, or the least
    memory a stage needs at the most stages the nodes online allow, against what they offer."""
    model = _Model(units, batch_size)
    counts = [m for m in set(micro_batches) if 1 <= m <= batch_size]
    largest = max(o.memory_bytes for o in offers)
    nodes = f"the {len(offers)} online node{'s' if len(offers) != 1 else ''}"
    for idx, unit in enumerate(units):
        alone = min(
            model.memory(idx, idx + 1, in_flight(s, m, 1), math.ceil(batch_size / m))
            for s in schedules
            for m in counts
        )
        if alone > largest:
            return (
                f"unit {idx} ({unit.name}) alone needs {_size(alone)}; {nodes}"
                f" offer{'s' if len(offers) == 1 else ''} {_size(largest)} at most"
            )
    most = min(len(offers), len(units))
    need = min(_least_peak(model, most, s, m) for s in schedules for m in counts)
    able = sum(1 for o in offers if o.memory_bytes >= need)
    head = f"the model needs {_size(need)} per stage at {most} stage{'s' if most != 1 else ''}"
    if able == 0:
        return f"{head}; {nodes} offer{'s' if len(offers) == 1 else ''} {_size(largest)} at most"
    return f"{head}; only {able} of {nodes} offer that much"


def _least_peak(model: _Model, stages: int, schedule: str, m: int) -> int:
    """The smallest largest-stage memory over every split of the units into ``stages`` stages."""
    n, b = len(model.units), math.ceil(model.batch_size / m)
    peak = {i: model.memory(i, n, in_flight(schedule, m, 1), b) for i in range(n)}
    for k in range(2, stages + 1):
        flight = in_flight(schedule, m, k)
        peak = {
            i: min(max(model.memory(i, j, flight, b), peak[j]) for j in range(i + 1, n - k + 2))
            for i in range(n - k + 1)
        }
    return peak[0]


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
