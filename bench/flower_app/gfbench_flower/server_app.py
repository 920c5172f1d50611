"""ServerApp: FedAvg over all nodes with server-side test accuracy every round.

Writes a JSON result (per-round wall-clock stamps, accuracy, node train_s) to
run-config `result-path` so bench/vs_flower.py can read it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from gfbench_flower.task import accuracy, build_model, load_npz, parse_hidden

torch.set_num_threads(1)
app = ServerApp()


class TimedFedAvg(FedAvg):
    """FedAvg that also keeps each node's reported train_s per round."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.node_metrics: dict[int, list[dict[str, float]]] = {}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        rows = []
        for r in replies:
            if r.has_content():
                m = r.content["metrics"]
                rows.append({k: float(m[k]) for k in ("train_s", "handler_s", "steps", "num-examples")})
        self.node_metrics[server_round] = rows
        return super().aggregate_train(server_round, replies)


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    n = int(rc["num-nodes"])
    rounds = int(rc["num-server-rounds"])
    hidden = parse_hidden(str(rc["hidden"]))
    data_dir = Path(str(rc["data-dir"]))
    result_path = Path(str(rc["result-path"]))
    model = build_model(int(rc["input-dim"]), hidden, int(rc["num-classes"]), int(rc["seed"]))
    xt, yt = load_npz(data_dir / "test.npz")
    stamps: list[float] = []
    accs: list[float] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        acc = accuracy(model, xt, yt)
        stamps.append(time.time())
        accs.append(acc)
        return MetricRecord({"accuracy": acc})

    strategy = TimedFedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=n,
        min_available_nodes=n,
    )
    t0 = time.time()
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=rounds,
        train_config=ConfigRecord({}),
        evaluate_fn=evaluate,
    )
    out = {
        "serverapp_start": t0,
        "round_end_time": stamps,
        "accuracy": accs,
        "node_metrics": {str(k): v for k, v in strategy.node_metrics.items()},
        "serverapp_pid": os.getpid(),
    }
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(result_path)
