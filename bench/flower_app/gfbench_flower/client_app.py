"""ClientApp: one local epoch of SGD on this node's shard."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gfbench_flower.task import build_model, load_npz, parse_hidden, train_epochs

torch.set_num_threads(1)
app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    t_start = time.perf_counter()
    rc = context.run_config
    pid = int(context.node_config["partition-id"])
    model = build_model(
        int(rc["input-dim"]), parse_hidden(str(rc["hidden"])), int(rc["num-classes"]), 0
    )
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_npz(Path(str(rc["data-dir"])) / f"shard_{pid}.npz")
    server_round = int(msg.content["config"].get("server-round", 0))
    loss, train_s, steps = train_epochs(
        model,
        x,
        y,
        epochs=int(rc["local-epochs"]),
        batch_size=int(rc["batch-size"]),
        lr=float(rc["lr"]),
        momentum=float(rc["momentum"]),
        seed=int(rc["seed"]) + 1000 * server_round + pid,
    )
    metrics = MetricRecord(
        {
            "train_loss": loss,
            "train_s": train_s,
            "handler_s": time.perf_counter() - t_start,
            "steps": steps,
            "pid": os.getpid(),
            "num-examples": len(x),
        }
    )
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)
