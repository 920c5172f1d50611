"""`gpuflex-hub demo`: the whole journey on this machine, with real processes.

A hub on loopback in a temporary folder, N node processes (one of them a misbehaving
contributor from the test tooling), the bundled digits job submitted through the owner
API, live rounds, and a summary with where the model is and how to look further.
Every process is stopped by PID on the way out, Ctrl+C included.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import owner_client as oc
from .localcluster import LocalCluster, Proc, attack_tooling_available, digits_job

ATTACKS = ("sign_flip", "scaled", "noise", "label_flip", "free_rider", "stale_replay", "half_shard")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "demo", help="run a hub, nodes and the bundled digits job on this machine"
    )
    p.add_argument("--nodes", type=int, default=4, help="node processes to start (default 4)")
    p.add_argument("--rounds", type=int, default=15, help="training rounds (default 15)")
    p.add_argument(
        "--misbehaving", type=int, default=1, help="how many of the nodes misbehave (default 1)"
    )
    p.add_argument(
        "--attack", choices=ATTACKS, default="sign_flip", help="what the misbehaving nodes do"
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep everything in this folder")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.set_defaults(func=run_demo)


def _names(cluster: LocalCluster) -> dict[str, str]:
    return {p.node_id: p.name for p in cluster.nodes()}


LEGEND = """\
How to read a round line:
  acc, loss     the new model's accuracy and loss on the validation set
  replicas      training done twice or more, so that nodes can be compared: samples trained
                beyond one pass over the data, as a share of the data (100% = every chunk twice)
  shards        who trained what this round: NAME:Nch = N chunks of the data; "r" = a replica
                (the same chunks and seed went to another node, the two updates are compared);
                [status] = not aggregated: [quarantined] = held for the auditor,
                [redundant] = an agreeing replica whose twin was aggregated
  FLAG          an update held back for the auditor, with the check it failed and its numbers"""


def hub_command() -> str:
    """`gpuflex-hub` as a shell can run it: the bare name when that resolves to this installation,
    else the script's path (`.venv/bin/gpuflex-hub` from a checkout), else `python -m`."""
    mine = Path(sys.executable).parent / "gpuflex-hub"
    on_path = shutil.which("gpuflex-hub")
    if mine.is_file():
        if on_path and Path(on_path).resolve() == mine.resolve():
            return "gpuflex-hub"
        try:
            shown = str(mine.absolute().relative_to(Path.cwd()))
        except ValueError:
            shown = str(mine.absolute())
        return shlex.quote(shown)
    if on_path:
        return "gpuflex-hub"
    return f"{shlex.quote(sys.executable)} -m gpuflex.hub"


def _round_line(entry: dict[str, Any], names: dict[str, str], flag_details: dict[str, str] | None = None) -> str:
    acc = entry.get("accuracy")
    loss = entry.get("loss")
    parts = []
    for u in entry["updates"]:
        who = names.get(u["node_id"], u["node_id"][:12])
        mark = "" if u["status"] == "included" else f" [{u['status']}]"
        replica = " r" if u.get("replica_group") else ""
        parts.append(f"{who}:{u['chunks']}ch{replica}{mark}")
    line = (
        f"round {entry['round']:>2}  acc {acc if acc is None else f'{acc:.3f}'}"
        f"  loss {loss if loss is None else f'{loss:.3f}'}"
        f"  replicas {entry.get('replication_overhead', 0.0):.0%}  shards {' '.join(parts)}"
    )
    for f in entry.get("flags", []):
        detail = (flag_details or {}).get(f.get("flag_id", ""), "")
        line += f"\n          FLAG {f['reason']} on {names.get(f['node_id'], f['node_id'])}"
        line += f": {detail}" if detail else ""
    return line


def _flag_details(url: str, token: str, entry: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in entry.get("flags", []):
        try:
            flag = asyncio.run(oc.request_json(url, token, "GET", f"/v1/flags/{f['flag_id']}"))
        except oc.OwnerClientError:
            continue
        out[f["flag_id"]] = str(flag.get("headline") or "")  # the hub's evidence.headline
    return out


def _start(console: Any, cluster: LocalCluster, args: argparse.Namespace, misbehaving: int,
           workdir: Path) -> tuple[str, str, str]:
    """Start the hub and the nodes, wait for them to register, and submit the digits job:
    (owner token, auditor token, job id)."""
    cluster.start_hub()
    console.print(f"hub    {cluster.url}  key {cluster.fingerprint}  (pid {cluster.hub and cluster.hub.pid})")
    token = cluster.create_token("owner", "demo-owner")
    auditor = cluster.create_token("auditor", "demo-auditor")

    for i in range(args.nodes):
        bad = i >= args.nodes - misbehaving
        name = f"node-{i + 1}" + (f"-{args.attack}" if bad else "")
        proc: Proc = cluster.start_node(name, attack=args.attack if bad else None)
        role = f"misbehaving ({args.attack})" if bad else "honest"
        console.print(f"node   {name:<22} {role:<24} id {proc.node_id}  pid {proc.pid}")

    console.print("waiting for the nodes to benchmark themselves and register ...")
    cluster.wait_registered(timeout_s=min(args.timeout, 180.0))
    files = digits_job(workdir / "job", rounds=args.rounds)
    job = asyncio.run(oc.submit_job(cluster.url, token, files.spec, files.train, files.val))
    job_id = str(job["id"])
    console.print(f"job    {job_id}: MLP 64-128-10 on scikit-learn digits, {args.rounds} rounds\n")
    console.print(LEGEND + "\n", markup=False)
    return token, auditor, job_id


def _follow(console: Any, cluster: LocalCluster, args: argparse.Namespace, tokens: tuple[str, str], job_id: str,
            workdir: Path) -> dict[str, Any] | None:
    """Print each round as it closes until the job ends: its last status, or None (said why) when
    the run timed out or the hub or every node exited."""
    from rich.markup import escape

    token, auditor = tokens
    names = _names(cluster)
    shown = 0
    reported_dead: set[str] = set()
    deadline = time.monotonic() + args.timeout
    while True:
        status: dict[str, Any] = asyncio.run(oc.job_status(cluster.url, token, job_id))
        for entry in status["history"][shown:]:
            details = _flag_details(cluster.url, auditor, entry) if entry.get("flags") else {}
            console.print(_round_line(entry, names, details), markup=False)  # "[quarantined]" is text
        shown = len(status["history"])
        if status["state"] in {"done", "failed", "cancelled"}:
            return status
        if time.monotonic() > deadline:
            console.print(f"[red]timed out after {args.timeout:.0f} s[/red] (state {status['state']})")
            return None
        for p in cluster.nodes():
            if not p.alive() and p.name not in reported_dead:
                reported_dead.add(p.name)
                tail = p.log.read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
                console.print(f"[yellow]{p.name} exited ({p.popen.returncode}): {escape(tail[0][:200])}[/yellow]")
        dead = [p.name for p in cluster.nodes() if not p.alive()]
        if cluster.hub is not None and not cluster.hub.alive():
            console.print(f"[red]the hub exited; see {cluster.hub.log}[/red]")
            return None
        if dead and len(dead) == len(list(cluster.nodes())):
            console.print(f"[red]every node exited; logs in {workdir / 'logs'}[/red]")
            return None
        time.sleep(0.3)


def _summary(console: Any, cluster: LocalCluster, tokens: tuple[str, str], job_id: str, status: dict[str, Any],
             started: float, keep: bool) -> None:
    """A finished job: its model, accuracy and flags, then how to explore further."""
    token, auditor = tokens
    model = cluster.workdir / "model.safetensors"  # (removed with a temporary folder: see the end)
    asyncio.run(oc.download_model(cluster.url, token, job_id, model))
    flags = asyncio.run(oc.request_json(cluster.url, auditor, "GET", f"/v1/flags?job={job_id}"))
    flags = flags["flags"]
    final = status["history"][-1]
    names = _names(cluster)
    elapsed = time.monotonic() - started
    console.print(f"\n[bold]done[/bold] in {elapsed:.1f} s")
    console.print(f"model          {model}" + ("" if keep else "  (removed with the demo's folder at the end)"))
    console.print(f"test accuracy  {final['accuracy']:.4f}  (val loss {final['loss']:.4f})")
    by_node: dict[str, list[str]] = {}
    for f in flags:
        by_node.setdefault(names.get(f["node_id"], f["node_id"]), []).append(f["reason"])
    console.print(f"audit          {len(flags)} open flag(s)")
    for who, reasons in sorted(by_node.items()):
        counts = {r: reasons.count(r) for r in sorted(set(reasons))}
        console.print(f"               {who}: " + ", ".join(f"{n}x {r}" for r, n in counts.items()))
    hub_cmd = hub_command()
    if not keep:
        console.print(f"\nexplore further: keep the hub's folder with --workdir, e.g. `{hub_cmd} demo --workdir"
                      " gpuflex-demo`; the demo then prints the commands to serve it again, follow the job,"
                      " review the flags and verify the audit log")
        return
    q = shlex.quote
    console.print("\nexplore further: start this hub again on its data folder, then")
    console.print(f"  {hub_cmd} serve --data {q(str(cluster.hub_dir))} --port {cluster.port} &")
    console.print(f"  export GPUFLEX_HUB={cluster.url} GPUFLEX_TOKEN={token}")
    console.print(f"  {hub_cmd} job status {job_id}")
    console.print(f"  GPUFLEX_TOKEN={auditor} {hub_cmd} audit list --job {job_id}")
    console.print(f"  {hub_cmd} audit verify-log --from {q(str(cluster.hub_dir))}")
    console.print(f"  web console: {cluster.url}/console/ (log in with a token)")


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    if args.nodes < 1:
        console.print("error: --nodes must be at least 1")
        return 2
    misbehaving = max(0, min(args.misbehaving, args.nodes - 1))
    if misbehaving and not attack_tooling_available():
        console.print(
            "note: misbehaving contributors come from tests/tooling in a source checkout; "
            "running with honest nodes only"
        )
        misbehaving = 0

    keep = args.workdir is not None  # a temporary folder holds keys and tokens: removed at the end
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpuflex-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # A real hub keeps a new identity on probation for an hour (--trust-min-age 3600): the demo
    # lasts seconds, so it shortens that to 3 s, so that trust forms and replication falls off
    # within the run, as it does on a long-lived hub within its first hour.
    cluster = LocalCluster(workdir=workdir, hub_args=("--long-poll-max", "10", "--min-deadline", "20",
                                                      "--trust-min-age", "3"))

    # SIGTERM behaves like Ctrl+C: unwind through `finally` and stop every child by PID.
    def _on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _on_term)
    started = time.monotonic()
    try:
        console.print(f"[bold]GPUFlex demo[/bold] in {workdir}")
        token, auditor, job_id = _start(console, cluster, args, misbehaving, workdir)
        status = _follow(console, cluster, args, (token, auditor), job_id, workdir)
        if status is None:
            return 1
        if status["state"] != "done":
            console.print(f"[red]job ended {status['state']}: {escape(str(status.get('error')))}[/red]")
            return 1
        _summary(console, cluster, (token, auditor), job_id, status, started, keep)
        return 0
    except KeyboardInterrupt:
        console.print("\ninterrupted: stopping every process")
        return 130
    finally:
        cluster.close()
        signal.signal(signal.SIGTERM, previous)
        if keep:
            console.print(f"stopped {len(cluster.procs)} process(es); files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            gone = "removed" if not workdir.exists() else "could not remove"
            console.print(f"stopped {len(cluster.procs)} process(es); {gone} {workdir} (keys, tokens, logs, model;"
                          " --workdir DIR keeps them)")
