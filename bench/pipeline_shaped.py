"""A pipelined job's throughput over shaped home lines against loopback, on real processes.

A real `gpuflex-hub serve` and four real `gpuflex-node run` processes (one thread each,
`--max-memory 16MB`, gpuflex.hub.ops.localcluster) train the transformer of
tests/test_e2e_pipeline.py (4 blocks of width 128, tied embeddings, batches of 16 in 8
micro-batches, SGD with momentum) in 4 stages on the standard library's sources, once per
boundary encoding (``fp32``, ``int8``, ``subspace`` of rank 16) under 1F1B and once with
``subspace`` under GPipe (a cap of 16MB lets a stage hold GPipe's 8 micro-batches), in the
set-ups below, one after another, in one run:

* **loopback, relay**: every node on 127.0.0.1, every tensor through the hub's relay;
* **loopback, direct**: the same, each node taking its stage's tensors on its own listener
  (``--stage-listen 127.0.0.1:PORT``);
* **shaped, relay**: each node in its own network namespace behind a home line
  (tests/tooling/netshape.py: ``tc … tbf`` at 20 Mbit/s up and 100 Mbit/s down, a 30 ms round
  trip and 0.1% packet loss each way from the packet relay between TUN devices), the hub on this
  side: every tensor goes up its sender's line and down its receiver's;
* **shaped, direct**: the same lines, each node listening on its namespace's address, the
  namespaces routed to each other through this side (IP forwarding on while the bench runs): a
  tensor goes up its sender's line and down its receiver's, without passing the hub;
* **shaped, relay, no loss**: the relay set-up again on the same lines without packet loss.

Throughput is the last stage's: the samples of the steps between its reports of step 1 and
step ``steps - 1`` (the hub's ``stage_reports.reported_at``), which leaves out the first step
(every stage's first step goes through the relay, whatever the path, and the first tensors wait
for the other stages to load) and the last (its checkpoint upload). ``checkpoint_every`` is the
job's step count and ``verify_rate`` 0, so no step in between is a checked or checkpoint step.
Over the shaped lines the packet relay's counters give the bytes each line carried up and down
per step while the steps were measured; the uplink's rate over the busiest line's bytes per step
is the line's bound on the steps a second.

Needs root (``ip netns``, ``tc``, ``/dev/net/tun``); every namespace, device and process it
makes is removed on the way out, Ctrl+C and SIGTERM included.

``--batch`` and ``--micro`` run the same job with other batches (the fill and the drain of a
step cost the same latency whatever its micro-batches, so a longer step amortises them);
``--max-memory`` raises the nodes' cap where a stage needs it (GPipe holds a whole step's
micro-batches). ``--skip-loss0`` leaves out the set-up without packet loss.

    python bench/pipeline_shaped.py [--steps 10] [--out bench/results/pipeline_shaped.json]
    python bench/pipeline_shaped.py --batch 64 --micro 32 --skip-loss0 \
        --out bench/results/pipeline_shaped_micro32.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuflex.hub.ops.localcluster import LocalCluster, Proc  # noqa: E402
from gpuflex.node.pipeline.schedule import stage_actions  # noqa: E402
from gpuflex.protocol.boundary import encoded_crossing  # noqa: E402

from tests.tooling import netshape  # noqa: E402
from tests.tooling.text import stdlib_text, transformer_pipeline_spec  # noqa: E402

STAGES, BATCH, MICRO, CONTEXT, WIDTH = 4, 16, 8, 32, 128
#: label -> (boundary encoding, its rank, schedule): the three encodings under the job's 1F1B,
#: and the smallest encoding under GPipe (every forward before any backward)
CONFIGS = {
    "fp32": ("fp32", 0, "1f1b"),
    "int8": ("int8", 0, "1f1b"),
    "subspace": ("subspace", 16, "1f1b"),
    "subspace+gpipe": ("subspace", 16, "gpipe"),
}
ENCODINGS = ("fp32", "int8", "subspace")
CAP = "16MB"
UP_MBIT, DOWN_MBIT, RTT_MS, LOSS = 20.0, 100.0, 30.0, 0.001
HUB_ARGS = ("--long-poll-max", "2", "--min-deadline", "4", "--stage-timeout", "30")
#: where a node in a namespace takes its stage's tensors (its namespace's address, this port)
STAGE_PORT = 7070
TEXT_BYTES = 24_000


# -- what crosses the cuts -----------------------------------------------------------------------


def message_bytes(label: str) -> int:
    """The bytes of one micro-batch's tensor crossing a cut (activation forward, or its gradient
    back: the same form), as its encoding sends it, without the GFT1 and sealed headers."""
    boundary, rank, _ = CONFIGS[label]
    dtype, shape = encoded_crossing((BATCH // MICRO, CONTEXT, WIDTH), "float32", boundary, rank)
    per = {"float32": 4, "int8": 1}[dtype]
    n = 1
    for d in shape:
        n *= d
    return n * per


def boundary_bytes_per_step(label: str) -> dict[str, int]:
    """Per step: what a middle stage sends (its activations forward and its input's gradients
    back), and the pipeline's whole boundary traffic (every cut, both ways)."""
    one = message_bytes(label)
    return {
        "message_bytes": one,
        "middle_stage_sends": 2 * MICRO * one,
        "all_cuts_both_ways": 2 * (STAGES - 1) * MICRO * one,
    }


def _boundary_lines(label: str) -> str:
    boundary, rank, _ = CONFIGS[label]
    if boundary == "fp32":
        return ""
    return f'boundary = "{boundary}"\n' + (f"boundary_rank = {rank}\n" if rank else "")


def schedule_floor_s(label: str, op_s: float) -> float:
    """The step time of the job's schedule (node/pipeline/schedule.stage_actions: each stage's
    order of forwards and backwards) when each forward or backward takes ``op_s`` and each
    tensor crossing a cut takes the shaped lines' one-way delay (the sender's half of the round
    trip up, the receiver's down) plus its bytes at the uplink's and the downlink's rate: what
    the latency and the bytes alone cost, with no hub, no headers and no step report."""
    size = message_bytes(label)
    crossing = RTT_MS / 1000 + size * 8 / (UP_MBIT * 1e6) + size * 8 / (DOWN_MBIT * 1e6)
    orders = [
        list(stage_actions(CONFIGS[label][2], stage=s, stages=STAGES, micro_batches=MICRO))
        for s in range(STAGES)
    ]
    finished: dict[tuple[str, int, int], float] = {}
    clock, nxt = [0.0] * STAGES, [0] * STAGES
    while any(nxt[s] < len(orders[s]) for s in range(STAGES)):
        for s in range(STAGES):
            while nxt[s] < len(orders[s]):
                a = orders[s][nxt[s]]
                if a.op == "F":  # the activation from the stage before
                    src, wait = ("F", s - 1, a.micro_batch), crossing
                    ready = 0.0 if s == 0 else finished.get(src)
                elif s == STAGES - 1:  # the loss's gradient: this stage's own forward
                    ready, wait = finished.get(("F", s, a.micro_batch)), 0.0
                else:  # the gradient from the stage after
                    ready, wait = finished.get(("B", s + 1, a.micro_batch)), crossing
                if ready is None:
                    break
                if s == 0 and a.op == "F":
                    wait = 0.0
                clock[s] = max(clock[s], ready + wait) + op_s
                finished[(a.op, s, a.micro_batch)] = clock[s]
                nxt[s] += 1
    return max(clock)


# -- the owner's side ----------------------------------------------------------------------------


class Owner:
    def __init__(self, cluster: LocalCluster, work: Path) -> None:
        self.cluster = cluster
        self.token = cluster.create_token("owner", "bench")
        self.work = work
        self.corpus = work / "corpus.txt"
        self.corpus.write_bytes(stdlib_text(TEXT_BYTES))

    def submit(self, label: str, steps: int) -> str:
        spec = self.work / f"spec-{label}.toml"
        spec.write_text(
            transformer_pipeline_spec(
                f"pipeline-shaped-{label}", batch=BATCH, micro=MICRO, steps=steps, every=steps, stages=STAGES,
                schedule=CONFIGS[label][2], context=CONTEXT, width=WIDTH,
                tail="verify_rate = 0.0\n" + _boundary_lines(label),
            )
        )  # fmt: skip
        argv = [
            sys.executable, "-m", "gpuflex.hub", "job", "submit", str(spec),
            "--train", str(self.corpus), "--hub", self.cluster.url, "--token", self.token, "--json",
        ]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=str(ROOT))
        return str(json.loads(out.stdout)["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.cluster.url}/v1/jobs/{job_id}",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return dict(json.loads(r.read()))


def _rows(hub_dir: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"{(hub_dir / 'hub.sqlite3').as_uri()}?mode=ro", uri=True)
    try:
        return list(conn.execute(sql, args).fetchall())
    finally:
        conn.close()


def _steps_done(doc: dict[str, Any]) -> int:
    g = (doc.get("pipeline") or {}).get("generation") or {}
    return int(g.get("steps_done") or 0)


def run_job(
    owner: Owner, label: str, steps: int, counters: Callable[[], dict[str, Any]] | None,
    netns_of: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """One job to its end; its last stage's throughput over steps 1 .. steps - 1, and (with
    ``counters``, the packet relay's; ``netns_of``: each node's line) the bytes each stage's
    line carried per step meanwhile."""
    started = time.monotonic()
    job_id = owner.submit(label, steps)
    marks: list[tuple[int, dict[str, Any]]] = []
    stage_nodes: list[str] = []
    while True:
        doc = owner.job(job_id)
        if doc["state"] in ("done", "failed", "cancelled"):
            break
        g = (doc.get("pipeline") or {}).get("generation") or {}
        if g and not stage_nodes:
            stage_nodes = [st["node_id"] for st in g["stages"]]
        done = _steps_done(doc)
        if counters is not None and (
            (not marks and done >= 1) or (len(marks) == 1 and done >= steps - 1)
        ):
            marks.append((done, counters()))
        if not stage_nodes and time.monotonic() - started > 120:
            raise SystemExit(
                f"{label}: no plan after 120 s: {(doc.get('pipeline') or {}).get('waiting')}"
            )
        if time.monotonic() - started > 600:
            raise SystemExit(f"{label}: the job did not end within 600 s: {doc.get('pipeline')}")
        time.sleep(0.2)
    if doc["state"] != "done":
        raise SystemExit(f"{label}: the job ended {doc['state']}: {doc.get('pipeline')}")
    gens = doc["pipeline"]["generations"]
    if len(gens) != 1:
        raise SystemExit(f"{label}: {len(gens)} generations (re-planned): {gens}")
    hub_dir = owner.cluster.hub_dir
    last = _rows(
        hub_dir,
        "SELECT steps_done, reported_at, step_s, predicted_s FROM stage_reports"
        " WHERE job_id = ? AND stage = ? ORDER BY steps_done",
        job_id, STAGES - 1,
    )  # fmt: skip
    at = {int(s): float(t) for s, t, _, _ in last}
    span = at[steps - 1] - at[1]
    walls = [float(w) for s, _, w, _ in last if 2 <= s <= steps - 1]
    stage_walls = _rows(
        hub_dir,
        "SELECT stage, step_s, compute_s FROM stage_reports WHERE job_id = ? AND steps_done"
        " BETWEEN 2 AND ?",
        job_id, steps - 1,
    )  # fmt: skip
    compute = {
        s: statistics.median(float(c) for st, _, c in stage_walls if st == s) for s in range(STAGES)
    }
    out: dict[str, Any] = {
        "job": job_id,
        "samples_per_s": round(BATCH * (steps - 2) / span, 3),
        "step_s": round(span / (steps - 2), 4),
        "last_stage_step_s_median": round(statistics.median(walls), 4),
        "stage_compute_s_median": {str(s): round(c, 4) for s, c in compute.items()},
        "predicted_step_s": round(float(last[-1][3]), 4),
        "job_wall_s": round(time.monotonic() - started, 1),
    }
    if len(marks) == 2 and stage_nodes:
        (s0, c0), (s1, c1) = marks
        per_line = {}
        for stage, node in enumerate(stage_nodes):
            name = netns_of[node]
            up = (c1[name]["up"]["bytes"] - c0[name]["up"]["bytes"]) / max(s1 - s0, 1)
            down = (c1[name]["down"]["bytes"] - c0[name]["down"]["bytes"]) / max(s1 - s0, 1)
            per_line[f"stage{stage}"] = {
                "up_bytes_per_step": round(up),
                "down_bytes_per_step": round(down),
            }
        out["lines"] = per_line
        out["lines_steps_counted"] = s1 - s0
    return out


# -- the four set-ups ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def ip_forwarding() -> Iterator[None]:
    """IPv4 forwarding on (the namespaces reach each other through this side), then as it was."""
    path = Path("/proc/sys/net/ipv4/ip_forward")
    before = path.read_text().strip()
    path.write_text("1\n")
    try:
        yield
    finally:
        path.write_text(f"{before}\n")


def start_nodes(
    cluster: LocalCluster,
    direct: bool,
    lines: list[netshape.HomeLine] | None,
    bench_cache: Path | None,
) -> list[Proc]:
    if bench_cache is not None and bench_cache.exists():
        cluster.workdir.mkdir(parents=True, exist_ok=True)
        shutil.copy(bench_cache, cluster.bench_cache)  # one benchmark for every cluster of the run
    procs: list[Proc] = []
    for i in range(STAGES):
        extra: tuple[str, ...] = ("--max-memory", CAP)
        if lines is None:
            if direct:
                extra += ("--stage-listen", f"127.0.0.1:{_free_port()}")
            procs.append(cluster.start_node(f"n{i}", extra=extra))
        else:
            line = lines[i]
            if direct:
                extra += ("--stage-listen", f"{line.node_ip}:{STAGE_PORT}")
            url = f"http://{line.hub_ip}:{cluster.port}"
            procs.append(
                cluster.start_node(f"n{i}", extra=extra, prefix=line.prefix(), hub_url=url)
            )
    cluster.wait_registered(procs, timeout_s=300)
    return procs


def run_setup(
    name: str, work: Path, steps: int, labels: list[str], *, direct: bool,
    homes: netshape.HomeLines | None, lines: list[netshape.HomeLine] | None, bench_cache: Path | None,
) -> dict[str, Any]:  # fmt: skip
    host = "0.0.0.0" if lines is not None else "127.0.0.1"
    out: dict[str, Any] = {}
    with LocalCluster(workdir=work / name, hub_args=HUB_ARGS, hub_host=host) as cluster:
        cluster.start_hub()
        procs = start_nodes(cluster, direct, lines, bench_cache)
        netns_of = {p.node_id: line.netns for p, line in zip(procs, lines or [], strict=False)}
        owner = Owner(cluster, work / name)
        for label in labels:
            r = run_job(owner, label, steps, homes.stats if homes is not None else None, netns_of)
            out[label] = r
            busiest = max((v["up_bytes_per_step"] for v in r.get("lines", {}).values()), default=0)
            print(
                f"  {name:16} {label:9} {r['samples_per_s']:8.2f} samples/s  step {r['step_s']:.3f} s"
                f"  (job {r['job_wall_s']:.0f} s"
                + (f", busiest uplink {busiest:,} B/step)" if busiest else ")"),
                flush=True,
            )
    return out


def shaped_setups(
    runs: dict[str, Any], work: Path, steps: int, labels: list[str], paths: list[str], *,
    loss: float, suffix: str, first: int, bench_cache: Path,
) -> None:  # fmt: skip
    homes = netshape.HomeLines(
        STAGES, up_mbit=UP_MBIT, down_mbit=DOWN_MBIT, rtt_ms=RTT_MS, loss=loss, first=first
    )
    with homes as lines, ip_forwarding():
        for line in lines:  # each namespace reaches the others through this side
            prefix = line.hub_ip.rsplit(".", 2)[0]
            subprocess.run(
                ["ip", "-n", line.netns, "route", "add", f"{prefix}.0.0/16", "via", line.hub_ip],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
        for path in paths:
            name = f"shaped_{path}{suffix}"
            runs[name] = run_setup(
                name, work, steps, labels, direct=path == "direct", homes=homes, lines=lines,
                bench_cache=bench_cache,
            )  # fmt: skip


def measure(
    steps: int, labels: list[str], work: Path, skip_direct: bool, skip_loss0: bool = False
) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    paths = ["relay"] if skip_direct else ["relay", "direct"]
    bench_cache = work / "bench.json"
    for path in paths:
        runs[f"loopback_{path}"] = run_setup(
            f"loopback_{path}", work, steps, labels, direct=path == "direct", homes=None, lines=None,
            bench_cache=bench_cache,
        )  # fmt: skip
        if not bench_cache.exists():
            shutil.copy(work / f"loopback_{path}" / "bench.json", bench_cache)
    shaped_setups(
        runs, work, steps, labels, paths, loss=LOSS, suffix="", first=1, bench_cache=bench_cache
    )
    if skip_loss0:
        return runs
    # the same lines without packet loss: how much of the shaped figure the lost packets cost
    shaped_setups(
        runs, work, steps, labels, ["relay"], loss=0.0, suffix="_loss0", first=1 + STAGES,
        bench_cache=bench_cache,
    )  # fmt: skip
    return runs


# -- the result ----------------------------------------------------------------------------------


#: (name in the ratios, the shaped set-up, its loopback baseline)
VARIANTS = (
    ("relay", "shaped_relay", "loopback_relay"),
    ("direct", "shaped_direct", "loopback_direct"),
    ("relay_loss0", "shaped_relay_loss0", "loopback_relay"),
)


def summarise(runs: dict[str, Any], labels: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    ratios: dict[str, Any] = {"throughput_shaped_vs_loopback": {}}
    figures: dict[str, Any] = {"samples_per_s": {}, "line_bound": {}}
    up_rate = UP_MBIT * 1e6 / 8
    for variant, shaped_name, loop_name in VARIANTS:
        if shaped_name not in runs:
            continue
        loop, shaped = runs[loop_name], runs[shaped_name]
        ratios["throughput_shaped_vs_loopback"][variant] = {
            lab: round(shaped[lab]["samples_per_s"] / loop[lab]["samples_per_s"], 3)
            for lab in labels
        }
        figures["samples_per_s"][variant] = {
            lab: {"loopback": loop[lab]["samples_per_s"], "shaped": shaped[lab]["samples_per_s"]}
            for lab in labels
        }
        figures["line_bound"][variant] = {}
        for lab in labels:
            if "lines" not in shaped[lab]:  # the steps went by between two looks at the job
                continue
            busiest = max(v["up_bytes_per_step"] for v in shaped[lab]["lines"].values())
            bound = BATCH * up_rate / busiest
            op_s = max(shaped[lab]["stage_compute_s_median"].values()) / (2 * MICRO)
            floor = schedule_floor_s(lab, op_s)
            figures["line_bound"][variant][lab] = {
                "busiest_uplink_bytes_per_step": busiest,
                "bound_samples_per_s": round(bound, 2),
                "measured_over_bound": round(shaped[lab]["samples_per_s"] / bound, 3),
                "schedule_floor_step_s": round(floor, 4),
                "step_s_over_schedule_floor": round(shaped[lab]["step_s"] / floor, 3),
            }
    figures["boundary_bytes"] = {lab: boundary_bytes_per_step(lab) for lab in labels}
    relay = ratios["throughput_shaped_vs_loopback"]["relay"]
    encodings = [lab for lab in labels if lab in ENCODINGS]  # under the job's 1F1B
    best = max(encodings, key=lambda lab: runs["shaped_relay"][lab]["samples_per_s"])
    figures["best_encoding_relay"] = best
    ratios["throughput_shaped_vs_loopback_best"] = relay[best]
    ratios["throughput_shaped_vs_loopback_fp32"] = relay["fp32"]
    if "subspace+gpipe" in relay:
        ratios["throughput_shaped_vs_loopback_gpipe"] = relay["subspace+gpipe"]
    return ratios, figures


def table(result: dict[str, Any], labels: list[str]) -> list[str]:
    runs, f = result["runs"], result["figures"]
    rows = [
        f"{'path':12} {'encoding':14} {'loopback s/s':>12} {'shaped s/s':>10} {'shaped/loop':>11}"
        f" {'step s':>7} {'floor s':>7} {'uplink B/step':>13} {'line bound s/s':>14} {'of bound':>8}"
    ]
    empty = {"busiest_uplink_bytes_per_step": 0, "bound_samples_per_s": 0.0}
    for variant, shaped_name, loop_name in VARIANTS:
        if shaped_name not in runs:
            continue
        for lab in labels:
            loop, shaped = runs[loop_name][lab], runs[shaped_name][lab]
            bound = f["line_bound"][variant].get(lab) or {
                **empty, "measured_over_bound": 0.0, "schedule_floor_step_s": 0.0
            }  # fmt: skip
            rows.append(
                f"{variant:12} {lab:14} {loop['samples_per_s']:>12.2f} {shaped['samples_per_s']:>10.2f}"
                f" {result['ratios']['throughput_shaped_vs_loopback'][variant][lab]:>11.3f}"
                f" {shaped['step_s']:>7.3f} {bound['schedule_floor_step_s']:>7.3f}"
                f" {bound['busiest_uplink_bytes_per_step']:>13,} {bound['bound_samples_per_s']:>14.1f}"
                f" {bound['measured_over_bound']:>8.3f}"
            )
    best = result["ratios"]["throughput_shaped_vs_loopback_best"]
    rows.append(
        f"{result['configuration']}: ratios.throughput_shaped_vs_loopback (relay, best encoding"
        f" under 1f1b, {f['best_encoding_relay']}): {best}  (target >= 0.8:"
        f" {'met' if best >= 0.8 else 'missed'})"
    )
    for variant, ratios in result["ratios"]["throughput_shaped_vs_loopback"].items():
        top = max(ratios, key=ratios.get)
        rows.append(
            f"  best of every encoding and schedule, {variant}: {top} {ratios[top]}"
            f" (target >= 0.8: {'met' if ratios[top] >= 0.8 else 'missed'})"
        )
    return rows


def main() -> int:
    global BATCH, MICRO, CAP  # the job's figures, as the options set them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps of each job (>= 4)")
    parser.add_argument(
        "--encodings",
        default=",".join(CONFIGS),
        help="comma-separated, of " + ", ".join(CONFIGS),
    )
    parser.add_argument("--skip-direct", action="store_true", help="only the relay path")
    parser.add_argument("--skip-loss0", action="store_true", help="no set-up without loss")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples a step")
    parser.add_argument("--micro", type=int, default=MICRO, help="micro-batches a step")
    parser.add_argument("--max-memory", default=CAP, help="each node's --max-memory")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline_shaped.json"))
    args = parser.parse_args()
    labels = [x for x in args.encodings.split(",") if x]
    if args.micro < 1 or args.batch % args.micro:
        parser.error("--batch must be a multiple of --micro")
    BATCH, MICRO, CAP = args.batch, args.micro, args.max_memory
    if "fp32" not in labels or any(x not in CONFIGS for x in labels) or args.steps < 4:
        parser.error("--encodings must include fp32 and name only known encodings; --steps >= 4")
    why = netshape.unavailable()
    if why:
        print(f"pipeline_shaped needs network namespaces: {why}", file=sys.stderr)
        return 2
    # a SIGTERM unwinds like Ctrl+C, so the namespaces and processes are removed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(
        f"{STAGES} stages, {MICRO} micro-batches of {BATCH // MICRO}, {args.steps} steps a job;"
        f" shaped: {UP_MBIT:g} Mbit/s up, {DOWN_MBIT:g} down, {RTT_MS:g} ms round trip, {LOSS:.1%} loss",
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuflex-pipeline-shaped-") as tmp:
        runs = measure(args.steps, labels, Path(tmp), args.skip_direct, args.skip_loss0)
    ratios, figures = summarise(runs, labels)
    result: dict[str, Any] = {
        "name": "pipeline_shaped",
        "baseline": "the same job, nodes, stages and micro-batches on loopback, same path, same run",
        "configuration": f"batches of {BATCH} in {MICRO} micro-batches",
        "ratios": ratios,
        "figures": figures,
        "runs": runs,
        "setup": {
            "model": f"transformer, 4 blocks, width {WIDTH}, context {CONTEXT}, vocab 256",
            "pipeline": f"{STAGES} stages, {MICRO} micro-batches of {BATCH // MICRO}, 1f1b (gpipe where named), "
            f"{args.steps} steps, throughput over steps 1..{args.steps - 1} of the last stage",
            "nodes": f"{STAGES} gpuflex-node run processes, one thread each, --max-memory {CAP}",
            "hub": "gpuflex-hub serve " + " ".join(HUB_ARGS),
            "line": {
                "up_mbit": UP_MBIT,
                "down_mbit": DOWN_MBIT,
                "rtt_ms": RTT_MS,
                "loss": LOSS,
                "tooling": "tests/tooling/netshape.py (tbf + TUN packet relay)",
            },
            "direct_shaped": "namespaces routed to each other through this side: a direct tensor "
            "crosses its sender's uplink and its receiver's downlink (60 ms round trip between nodes)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "wall_s": round(time.monotonic() - started, 1),
        },
    }
    result["table"] = table(result, labels)
    print("\n".join(result["table"]))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
