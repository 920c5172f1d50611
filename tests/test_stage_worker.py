"""node/pipeline/worker.StageWorker: a node's run of one StageAssignment, with real torch, stages in
threads over the in-memory transport and a hub made of plain objects holding real bytes.

After 10 steps every parameter equals single-process gradient accumulation over the same
step_samples micro-batches (a transformer with tied embeddings, a sequential stack; 2-4 stages);
a new generation resumed from the uploaded unit states, cut at other boundaries, equals the
uninterrupted run; NaN, a silent neighbour, a stale generation and an Ack with ok=False end a
stage as the contract says."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from gpuflex.node.errors import AssignmentRejected, StaleGeneration
from gpuflex.node.pipeline.transport import MemoryNetwork, SendAhead
from gpuflex.node.pipeline.worker import StageOutcome, StageWorker
from gpuflex.node.stagework import check_stage_assignment, stage_line
from gpuflex.node.trainer import loss_for, make_optimizer
from gpuflex.protocol.dropout import dropout_step
from gpuflex.protocol.finetune import LoraConfig, with_lora
from gpuflex.protocol.messages import (
    ChunkRef,
    StageAssignment,
    StageReport,
    TrainConfig,
    UnitCheckpoint,
    UnitState,
)
from gpuflex.protocol.modelspec import ModelSpec, build_for_state, build_model
from gpuflex.protocol.pipeline import micro_batch_slices, pipeline_units, put_state, step_samples
from gpuflex.protocol.tensors import decode_state, encode_state, sha256_hex

torch.set_num_threads(1)

BATCH, MICRO, STEPS, SEED = 8, 4, 10, 5
ADAM = TrainConfig(1, BATCH, "adam", 1e-2, 0.0, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
SGD = TrainConfig(1, BATCH, "sgd", 0.2, 0.9, 1e-4, 0.9, 0.999, "cross_entropy", 0.0)
SGD_LM = TrainConfig(1, BATCH, "sgd", 0.3, 0.9, 0.0, 0.9, 0.999, "cross_entropy", 0.0)
MSE = TrainConfig(1, BATCH, "sgd", 1e-2, 0.0, 0.0, 0.9, 0.999, "mse", 0.0)

TRANSFORMER = ModelSpec.from_dict(
    {"kind": "transformer", "vocab": 13, "context": 6, "layers": 2, "width": 8, "heads": 2}
)
STACK = ModelSpec.from_dict(
    {
        "kind": "sequential",
        "input_shape": [12],
        "layers": [
            {"type": "Linear", "in_features": 12, "out_features": 16},
            {"type": "Tanh"},
            {"type": "Linear", "in_features": 16, "out_features": 16},
            {"type": "ReLU"},
            {"type": "Linear", "in_features": 16, "out_features": 8},
            {"type": "Tanh"},
            {"type": "Linear", "in_features": 8, "out_features": 5},
        ],
        "outputs": 5,
    }
)
REGRESSION = ModelSpec.from_dict(
    {"kind": "mlp", "input": 4, "hidden": [6], "outputs": 2, "task": "regression"}
)


class Hub:
    """The hub's blob store, checkpoint records and reports (thread-safe); ``ok`` is what a
    report's Ack says."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = dict(blobs)
        self.lock = threading.Lock()
        self.checkpoints: dict[tuple[int, int], UnitCheckpoint] = {}
        self.reports: list[StageReport] = []
        self.downloads: list[str] = []
        self.ok = True

    def put(self, body: bytes) -> tuple[str, int]:
        sha = sha256_hex(body)
        with self.lock:
            self.blobs[sha] = body
        return sha, len(body)

    def states_at(self, step: int, units: range) -> tuple[UnitState, ...]:
        return tuple(
            UnitState(u, self.checkpoints[(step, u)].sha256, self.checkpoints[(step, u)].size)
            for u in units
        )

    def model_at(self, spec: ModelSpec, step: int) -> dict[str, torch.Tensor]:
        """The whole model from the units' checkpoints at ``step`` (as the hub assembles it)."""
        units = pipeline_units(spec)
        state: dict[str, torch.Tensor] = {}
        for i, unit in enumerate(units.units):
            blob = decode_state(self.blobs[self.checkpoints[(step, i)].sha256])
            put_state(unit, {k: v for k, v in blob.items() if not k.startswith("optim.")}, state)
        return state


class NodeSide:
    """One node's view of the hub (StageHub): its own blob cache in front of the hub's store."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.cache: dict[str, bytes] = {}

    def blob(self, sha256: str, size: int) -> bytes:
        if sha256 not in self.cache:
            with self.hub.lock:
                self.hub.downloads.append(sha256)
                body = self.hub.blobs[sha256]
            assert len(body) == size and sha256_hex(body) == sha256
            self.cache[sha256] = body
        return self.cache[sha256]

    def keep(self, sha256: str, body: bytes) -> None:
        self.cache[sha256] = body

    def checkpoint(self, header: UnitCheckpoint, body: bytes) -> None:
        assert sha256_hex(body) == header.sha256 and len(body) == header.size
        with self.hub.lock:
            self.hub.blobs[header.sha256] = body
            self.hub.checkpoints[(header.step, header.unit)] = header

    def report(self, report: StageReport) -> bool:
        with self.hub.lock:
            self.hub.reports.append(report)
        return self.hub.ok


def dataset(spec: ModelSpec, n: int = 40, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if spec.task == "language_model":
        x = torch.randint(0, spec.vocab, (n, *spec.input_shape), generator=g)
        return x, (x + 1) % spec.vocab  # learnable: the next token follows the current one
    x = torch.randn(n, *spec.input_shape, generator=g)
    if spec.task == "regression":
        return x, torch.randn(n, spec.outputs, generator=g)
    return x, x[:, : spec.outputs].argmax(1)  # learnable: the largest of the first features


class Job:
    """A pipelined job on ``hub``: its model blob and two chunks of its data."""

    def __init__(self, spec: ModelSpec, cfg: TrainConfig, *, data=None) -> None:
        self.spec, self.cfg = spec, cfg
        self.x, self.y = data if data is not None else dataset(spec)
        self.hub = Hub({})
        self.model = build_model(spec, 0).state_dict()
        self.model_hash, self.model_size = self.hub.put(encode_state(self.model))
        half = int(self.x.shape[0]) // 2
        self.chunks = tuple(
            ChunkRef(*self.hub.put(encode_state({"x": self.x[lo:hi], "y": self.y[lo:hi]})), hi - lo)
            for lo, hi in ((0, half), (half, int(self.x.shape[0])))
        )
        self.units = len(pipeline_units(spec))

    def assignment(self, starts: list[int], stage: int, **over) -> StageAssignment:
        bounds = [*starts, self.units]
        fields = dict(
            job_id="job-pp",
            generation=1,
            node_id=f"node-{stage}",
            stage=stage,
            unit_start=bounds[stage],
            unit_end=bounds[stage + 1],
            stage_nodes=tuple(f"node-{s}" for s in range(len(starts))),
            stage_keys=tuple(bytes([s]) * 32 for s in range(len(starts))),
            stage_starts=tuple(starts),
            model_spec=self.spec.to_dict(),
            model_hash=self.model_hash,
            model_size=self.model_size,
            unit_states=(),
            chunks=self.chunks if stage in (0, len(starts) - 1) else (),
            train=self.cfg,
            seed=SEED,
            batch_size=BATCH,
            micro_batches=MICRO,
            schedule="1f1b",
            first_step=0,
            end_step=STEPS,
            checkpoint_every=5,
            issued_at=time.time(),
        )
        fields.update(over)
        fields["unit_states"] = tuple(
            s for s in fields["unit_states"] if bounds[stage] <= s.unit < bounds[stage + 1]
        )
        return StageAssignment(**fields)

    def run(self, starts: list[int], *, timeout_s: float = 30.0, **over) -> list[StageOutcome]:
        """Every stage of the cut ``starts``, one thread each, over one memory network."""
        network = MemoryNetwork()
        outcomes: list[StageOutcome | None] = [None] * len(starts)

        def work(stage: int) -> None:
            worker = StageWorker(
                self.assignment(starts, stage, **over),
                hub=NodeSide(self.hub),
                transport=network.transport(),
                peer_timeout_s=timeout_s,
                start_timeout_s=timeout_s,
            )
            outcomes[stage] = worker.run()

        threads = [threading.Thread(target=work, args=(s,)) for s in range(len(starts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    def reference(self, steps: int = STEPS) -> dict[str, torch.Tensor]:
        """One process, the whole model, each step's micro-batches accumulated."""
        model = build_for_state(self.spec, self.model).train()
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], self.cfg)
        loss_fn = loss_for(self.spec, self.cfg)
        for step in range(steps):
            index = torch.tensor(step_samples(SEED, step, BATCH, int(self.x.shape[0])))
            opt.zero_grad()
            for i, (lo, hi) in enumerate(micro_batch_slices(BATCH, MICRO)):
                part = index[lo:hi]
                with dropout_step(SEED, step, part=i):
                    loss = loss_fn(model(self.x[part]), self.y[part]) * ((hi - lo) / BATCH)
                loss.backward()
            opt.step()
        return model.state_dict()


def max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    return max(
        float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12))
        for k in want
        if want[k].is_floating_point()
    )


CUTS = {2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 2, 3]}


#: a mixture of experts in every block (router jitter and capacity drops on): each stage adds its
#: own routers' balancing loss, as one process adds them all to the logits' loss
MOE = ModelSpec.from_dict(
    {
        "kind": "transformer",
        "vocab": 13,
        "context": 6,
        "layers": 2,
        "width": 8,
        "heads": 2,
        "experts": 4,
        "top_k": 2,
        "capacity_factor": 1.0,
        "router_jitter": 0.1,
        "aux_loss_weight": 0.05,
    }
)
#: LoRA jobs (protocol/finetune.py): frozen weights in int8 (the transformer's tied embedding
#: frozen on both end stages), adapters trained in fp32
LORA_TRANSFORMER = with_lora(TRANSFORMER, LoraConfig(rank=2, alpha=4.0), where="train")
LORA_STACK = with_lora(STACK, LoraConfig(rank=3, alpha=6.0, targets=("Linear",)), where="train")


@pytest.mark.parametrize(
    ("spec", "cfg", "stages"),
    [
        (TRANSFORMER, SGD_LM, 2),
        (TRANSFORMER, SGD_LM, 4),
        (STACK, SGD, 3),
        (STACK, ADAM, 2),
        (LORA_TRANSFORMER, ADAM, 3),
        (LORA_STACK, ADAM, 2),
        (MOE, SGD_LM, 2),
        (MOE, SGD_LM, 4),
    ],
    ids=[
        "transformer-2",
        "transformer-4",
        "stack-3",
        "stack-2",
        "lora-int8-lm-3",
        "lora-int8-2",
        "moe-2",
        "moe-4",
    ],
)
def test_stages_equal_gradient_accumulation(spec: ModelSpec, cfg: TrainConfig, stages: int) -> None:
    """The transformer trains with SGD here: the gradient of an attention key's bias is zero up
    to rounding, and Adam scales that rounding up to a full step, so the order in which the
    stages add the tied embedding's two gradients (not autograd's) would show. The resumed run
    below compares Adam against the pipeline itself."""
    job = Job(spec, cfg)
    outcomes = job.run(CUTS[stages])
    assert [o.ended for o in outcomes] == ["done"] * stages, outcomes
    assert all(o.steps_done == STEPS for o in outcomes)
    want = job.reference()
    assert max_rel_diff(job.hub.model_at(spec, STEPS), want) <= 1e-5
    assert max_rel_diff(job.hub.model_at(spec, 5), job.reference(5)) <= 1e-5
    # every stage reported every step; the last stage's losses, no one else's
    for s in range(stages):
        mine = [r for r in job.hub.reports if r.stage == s]
        assert [r.steps_done for r in mine] == list(range(1, STEPS + 1))
        assert all(not r.failed and r.generation == 1 for r in mine)
        assert all((r.loss is not None) == (s == stages - 1) for r in mine)
        # each step's end (the optimizer step) timed apart, a part of its compute
        assert all(0 < r.update_s <= r.compute_s for r in mine)
        # the fixed time per unit and micro-batch, measured once before the first step and said
        # in every report (on a loaded machine the intercept may come out at its floor, 0)
        assert len({r.unit_overhead_s for r in mine}) == 1 and 0 <= mine[0].unit_overhead_s < 1
    losses = [r.loss for r in job.hub.reports if r.stage == stages - 1]
    assert losses[-1] < losses[0]  # it trains
    if (
        spec.lora is not None
    ):  # the stages held the frozen weights in int8, untouched; adapters trained
        final = job.hub.model_at(spec, STEPS)
        frozen = [k for k in final if k.endswith("weight_q")]
        assert frozen and all(final[k].dtype == torch.int8 for k in frozen)
        assert all(
            torch.equal(final[k], job.model[k])
            for k in final
            if not k.endswith(("lora_a", "lora_b"))
        )
        assert all(
            final[k].abs().max() > 0 for k in final if k.endswith("lora_b")
        )  # B starts at zero


@pytest.mark.parametrize(
    ("spec", "cfg", "counts"),
    [(TRANSFORMER, SGD_LM, (2, 2)), (STACK, ADAM, (3, 1))],
    ids=["lm-even", "stack-3-1"],
)
def test_two_pipelines_sharing_the_steps_equal_gradient_accumulation(
    spec: ModelSpec, cfg: TrainConfig, counts: tuple[int, int]
) -> None:
    """Hybrid parallelism on the node's own worker: 2 pipelines of 2 stages (the transformer's
    tied embedding on both ends), each running 2 of a step's 4 micro-batches and summing its
    stages' gradients with the other's. The model pipeline 0 checkpoints equals one process
    accumulating all 4 micro-batches; pipeline 1 checkpoints nothing and holds the same model."""
    job = Job(spec, cfg)
    starts = [0, 2]
    flat = [*starts, *starts]
    network = MemoryNetwork()
    outcomes: dict[int, StageOutcome] = {}
    workers: dict[int, StageWorker] = {}

    def work(slot: int) -> None:
        a = dataclasses.replace(
            job.assignment(starts, slot % 2),
            node_id=f"node-{slot}",
            stage=slot,
            stage_nodes=tuple(f"node-{s}" for s in range(4)),
            stage_keys=tuple(bytes([s]) * 32 for s in range(4)),
            stage_starts=tuple(flat),
            micro_batches=counts[slot // 2],
            lanes=2,
            lane_micro_batches=counts if counts[0] != counts[1] else (),
        )
        check_stage_assignment(a, node_id=f"node-{slot}")
        workers[slot] = StageWorker(a, hub=NodeSide(job.hub), transport=network.transport())
        outcomes[slot] = workers[slot].run()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [outcomes[s].ended for s in range(4)] == ["done"] * 4, outcomes
    assert max_rel_diff(job.hub.model_at(spec, STEPS), job.reference()) <= 1e-5
    assert {r.stage for r in job.hub.reports} == {0, 1, 2, 3}
    for a, b in ((0, 2), (1, 3)):
        for x, y in zip(workers[a].unit_states(), workers[b].unit_states(), strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x)


def test_a_resumed_generation_cut_elsewhere_equals_the_uninterrupted_run() -> None:
    job = Job(TRANSFORMER, ADAM)
    job.run([0, 2])
    want = job.hub.model_at(TRANSFORMER, STEPS)
    first_gen = dict(job.hub.checkpoints)
    job.hub.checkpoints = {k: v for k, v in first_gen.items() if k[0] == 5}
    states = job.hub.states_at(5, range(job.units))
    job.hub.downloads.clear()
    outcomes = job.run([0, 1, 3], generation=2, first_step=5, unit_states=states)
    assert [o.ended for o in outcomes] == ["done"] * 3
    assert max_rel_diff(job.hub.model_at(TRANSFORMER, STEPS), want) <= 1e-5
    assert job.model_hash not in job.hub.downloads  # from the unit states, not the model
    resumed = [r for r in job.hub.reports if r.generation == 2]
    assert sorted({r.steps_done for r in resumed}) == list(range(6, STEPS + 1))


def test_a_unit_state_in_the_nodes_cache_is_not_downloaded_again() -> None:
    job = Job(STACK, SGD)
    a = job.assignment([0], 0, end_step=5)
    node = NodeSide(job.hub)
    assert StageWorker(a, hub=node, transport=MemoryNetwork().transport()).run().ended == "done"
    states = job.hub.states_at(5, range(job.units))
    job.hub.downloads.clear()
    again = job.assignment([0], 0, generation=2, first_step=5, unit_states=states)
    assert StageWorker(again, hub=node, transport=MemoryNetwork().transport()).run().ended == "done"
    assert job.hub.downloads == []


def test_a_nan_loss_fails_the_stage_and_says_so() -> None:
    x, y = dataset(REGRESSION)
    job = Job(REGRESSION, MSE, data=(x, torch.full_like(y, 3e38)))
    outcomes = job.run([0, 1], timeout_s=1.0)
    assert outcomes[1].ended == "failed" and "the loss of step 0 is" in outcomes[1].detail
    assert outcomes[0].ended == "failed"
    failed = {r.stage: r.failed for r in job.hub.reports if r.failed}
    assert set(failed) == {0, 1} and "\n" not in failed[1]
    assert not job.hub.checkpoints


def test_a_neighbour_that_never_sends_fails_the_stage() -> None:
    job = Job(STACK, SGD)
    worker = StageWorker(
        job.assignment([0, 2], 1),
        hub=NodeSide(job.hub),
        transport=MemoryNetwork().transport(),
        peer_timeout_s=30.0,
        start_timeout_s=0.2,
    )
    outcome = worker.run()
    assert outcome.ended == "failed" and outcome.steps_done == 0
    assert "did not arrive within 0.2 s" in outcome.detail
    (report,) = job.hub.reports
    assert report.steps_done == 0 and "did not arrive" in report.failed


class StaleTransport:
    def send(self, key, tensor, sketch=b"") -> None:
        raise StaleGeneration("the hub's relay refused it: 409 stale_generation")

    def receive(self, key, expected, *, timeout_s):
        raise StaleGeneration("the hub's relay refused it: 409 stale_generation")


def test_a_stale_generation_ends_the_stage_quietly() -> None:
    job = Job(STACK, SGD)
    outcome = StageWorker(
        job.assignment([0, 2], 0), hub=NodeSide(job.hub), transport=StaleTransport()
    ).run()
    assert outcome.ended == "stale" and job.hub.reports == []


def test_an_ack_with_ok_false_ends_the_generation() -> None:
    job = Job(STACK, SGD)
    job.hub.ok = False
    outcome = StageWorker(
        job.assignment([0], 0), hub=NodeSide(job.hub), transport=MemoryNetwork().transport()
    ).run()
    assert (outcome.ended, outcome.steps_done) == ("over", 1)
    assert len(job.hub.reports) == 1
    last = StageWorker(  # the last step's Ack may say the job is done: the stage is done
        job.assignment([0], 0, end_step=1),
        hub=NodeSide(job.hub),
        transport=MemoryNetwork().transport(),
    ).run()
    assert (last.ended, last.steps_done) == ("done", 1)


def test_a_unit_state_that_does_not_fit_fails_the_stage_in_one_line() -> None:
    job = Job(STACK, SGD)
    sha, size = job.hub.put(encode_state({"0.weight": torch.zeros(3, 3)}))
    states = tuple(UnitState(u, sha, size) for u in range(job.units))
    outcome = StageWorker(
        job.assignment([0], 0, first_step=5, unit_states=states),
        hub=NodeSide(job.hub),
        transport=MemoryNetwork().transport(),
    ).run()
    assert outcome.ended == "failed" and "does not fit unit layers_0_1" in outcome.detail
    assert "\n" not in outcome.detail


# -- the node's checks on a StageAssignment ---------------------------------------------------------


def _bad(job: Job, **over) -> StageAssignment:
    a = job.assignment([0, 2], 1)
    return dataclasses.replace(a, **over)


def _refusals(job: Job) -> list[tuple[StageAssignment, str]]:
    return [
        (_bad(job, node_id="node-9"), "is for node-9, not this node"),
        (_bad(job, stage=2), "stage 2 of 2 nodes, 2 keys and 2 stage starts"),
        (_bad(job, stage_keys=(bytes(32),)), "stage 1 of 2 nodes, 1 keys and 2 stage starts"),
        (_bad(job, stage_nodes=("node-1", "node-0")), "its plan gives stage 1 to node-0"),
        (_bad(job, unit_start=1), "units 1-3 are not stage 1 of a 4-unit model cut at [0, 2]"),
        (_bad(job, stage_starts=(0, 5)), "are not stage 1 of a 4-unit model cut at [0, 5]"),
        (
            _bad(job, micro_batches=3),
            "3 micro-batches do not divide the batch of 8",
        ),
        (
            _bad(job, lane_micro_batches=(4, 4)),
            "micro-batch counts [4, 4] for 1 pipeline(s) do not give pipeline 0 its 4",
        ),
        (
            _bad(job, lanes=2),
            "pipeline 1 is cut at [2], pipeline 0 at [0]: every pipeline must cut",
        ),
        (_bad(job, lanes=3), "2 stages do not make 3 equal pipelines"),
        (_bad(job, first_step=10), "steps 10 up to 10 run backwards"),
        (_bad(job, first_step=5), "resuming at step 5 needs the states of units 2-3, it names []"),
        (_bad(job, unit_states=(UnitState(2, "a" * 64, 9),)), "step 0 starts from the model"),
        (_bad(job, chunks=()), "stage 1 needs chunks, it names 0"),
        (
            _bad(job, train=dataclasses.replace(SGD, precision="bf16")),
            "asks for precision bf16; a pipeline stage on this node trains in fp32",
        ),
        (_bad(job, train=dataclasses.replace(SGD, grad_clip=1.0)), "asks for gradient clipping"),
        (_bad(job, model_spec={"kind": "mlp"}), "model spec refused"),
    ]


def test_a_bad_stage_assignment_is_refused_in_one_line() -> None:
    job = Job(STACK, SGD)
    good = job.assignment([0, 2], 1)
    assert check_stage_assignment(good, node_id="node-1") == STACK
    middle = job.assignment([0, 1, 3], 1)
    assert check_stage_assignment(middle, node_id="node-1") == STACK
    with pytest.raises(AssignmentRejected, match="reads no chunks, it names 2"):
        check_stage_assignment(dataclasses.replace(middle, chunks=job.chunks), node_id="node-1")
    for bad, words in _refusals(job):
        with pytest.raises(AssignmentRejected) as info:
            check_stage_assignment(bad, node_id="node-1")
        assert words in str(info.value), (words, str(info.value))
        assert "\n" not in str(info.value)
    with pytest.raises(AssignmentRejected, match=r"stage 1 was already run \(replay\)"):
        check_stage_assignment(good, node_id="node-1", seen={("job-pp", 1, 1)})
    assert stage_line(good) == "stage 1 of 2 (units 2-3) of job job-pp, steps 0-9"


def test_a_node_that_stops_ends_its_stage_between_steps_and_says_so() -> None:
    job = Job(STACK, SGD)
    steps: list[tuple[int, float | None]] = []
    outcome = StageWorker(
        job.assignment([0], 0),
        hub=NodeSide(job.hub),
        transport=MemoryNetwork().transport(),
        should_stop=lambda: len(steps) >= 3,
        on_step=lambda done, loss: steps.append((done, loss)),
    ).run()
    assert (outcome.ended, outcome.steps_done) == ("stopped", 3)
    assert [done for done, _ in steps] == [1, 2, 3] and all(loss is not None for _, loss in steps)
    assert [r.failed[:8] for r in job.hub.reports] == ["", "", "", "stopped:"]
    assert job.hub.reports[-1].steps_done == 3


def test_a_direct_listener_takes_the_largest_replica_gradient_of_pipelines_sharing_the_steps() -> (
    None
):
    """A stage's direct listener refuses anything larger than the largest tensor its pipeline can
    send: with two pipelines sharing the steps that is a unit's whole parameter gradient."""
    from gpuflex.node.pipeline.stage import replica_length
    from gpuflex.node.stagelinks import largest_message_bytes
    from gpuflex.protocol.tensors import TensorSpec, max_encoded_size

    job = Job(TRANSFORMER, SGD_LM)
    one = job.assignment([0, 2], 0)
    two = dataclasses.replace(
        one,
        stage_nodes=tuple(f"node-{s}" for s in range(4)),
        stage_keys=tuple(bytes([s]) * 32 for s in range(4)),
        stage_starts=(0, 2, 0, 2),
        micro_batches=MICRO // 2,
        lanes=2,
    )
    biggest = max(replica_length(u.module) for u in pipeline_units(TRANSFORMER).units)
    assert largest_message_bytes(one) < max_encoded_size(
        (TensorSpec("replica", "float32", (biggest,)),)
    )
    assert largest_message_bytes(two) == max_encoded_size(
        (TensorSpec("replica", "float32", (biggest,)),)
    )


class SlowSends:
    """An in-memory transport whose every send takes ``delay_s`` before it is delivered, and
    which records the steps its stage asked to receive ahead (``expect``)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.expected_steps: set[int] = set()

    def send(self, key, tensor, sketch=b"") -> None:
        time.sleep(self.delay_s)
        self.inner.send(key, tensor, sketch)

    def receive(self, key, expected, *, timeout_s):
        return self.inner.receive(key, expected, timeout_s=timeout_s)

    def expect(self, keys) -> None:
        self.expected_steps |= {k.step for k in keys}


def test_a_step_reports_before_its_last_sends_land_but_a_checkpoint_waits_for_them() -> None:
    job = Job(STACK, SGD)
    network = MemoryNetwork()
    seen: list[tuple[int, int, set[int]]] = []  # (stage, steps_done, steps asked ahead) per report
    pending: dict[int, list[int]] = {0: [], 1: []}  # sends not yet delivered, at each report
    outcomes: list[StageOutcome | None] = [None, None]

    def work(stage: int) -> None:
        links = SlowSends(network.transport(), 0.02 if stage == 1 else 0.0)
        ahead = SendAhead([links], links)
        side = NodeSide(job.hub)
        report = side.report

        def watched(r: StageReport) -> bool:
            pending[stage].append(ahead._queue.unfinished_tasks)
            seen.append((stage, r.steps_done, set(links.expected_steps)))
            return report(r)

        side.report = watched  # type: ignore[method-assign]
        worker = StageWorker(job.assignment([0, 2], stage), hub=side, transport=ahead)
        try:
            outcomes[stage] = worker.run()
        finally:
            ahead.close()

    threads = [threading.Thread(target=work, args=(s,)) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [o.ended for o in outcomes if o is not None] == ["done", "done"]
    # stage 1's gradients of a step's last micro-batch are still on their way when it reports,
    # except at the checkpoint steps (5 and 10), whose state is stored once they have landed
    at = dict(zip(range(1, STEPS + 1), pending[1], strict=True))
    assert at[5] == at[10] == 0
    assert any(at[s] > 0 for s in at if s not in (5, 10))
    # each step's receives were asked for before the step before it reported
    for stage, done, asked in seen:
        assert done == STEPS or done in asked, (stage, done, asked)
    assert max_rel_diff(job.hub.model_at(STACK, STEPS), job.reference()) < 1e-5


@pytest.mark.parametrize(("micro", "sends", "receives"), [(2, 4, 8), (16, 16, 16), (64, 64, 64), (128, 96, 96)])
def test_relay_links_keep_a_step_of_micro_batches_in_flight(micro, sends, receives) -> None:
    from gpuflex.node.pipeline.relay import RelayTransport
    from gpuflex.node.stagelinks import stage_links
    from gpuflex.protocol.signing import SigningKey

    job = Job(TRANSFORMER, SGD_LM)
    a = job.assignment([0, 2], 1, micro_batches=micro, batch_size=2 * micro)
    made: list[RelayTransport] = []

    def relay() -> RelayTransport:  # connects on first use only: no hub needed here
        made.append(RelayTransport("http://127.0.0.1:9", SigningKey.generate(), a.job_id))
        return made[-1]

    links = stage_links(a, relay, key=None)
    try:
        assert len(links.transport.senders) == sends
        assert len(made) == sends + receives + 1  # one per fetching thread, and the caller's own
    finally:
        links.close()


def test_a_stage_runs_its_next_step_while_its_report_is_on_its_way() -> None:
    job = Job(STACK, SGD)
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    side = NodeSide(job.hub)
    report = side.report

    def slow(r: StageReport) -> bool:  # a hub a long round trip away
        with lock:
            events.append(("report", r.steps_done))
        time.sleep(0.05)
        with lock:
            events.append(("answered", r.steps_done))
        return report(r)

    started = iter(range(STEPS))

    def starting() -> bool:  # polled as each step starts
        with lock:
            events.append(("start", next(started)))
        return False

    side.report = slow  # type: ignore[method-assign]
    worker = StageWorker(
        job.assignment([0], 0),
        hub=side,
        transport=MemoryNetwork().transport(),
        should_stop=starting,
    )
    assert worker.run() == StageOutcome("done", STEPS)
    # every report reached the hub, in order, the last answered before the run returned
    assert [d for what, d in events if what == "answered"] == list(range(1, STEPS + 1))
    # step k (the one after k steps) started while the report of k steps was on its way
    for k in range(1, STEPS):
        assert events.index(("start", k)) < events.index(("answered", k))
    assert max_rel_diff(job.hub.model_at(STACK, STEPS), job.reference()) < 1e-5
