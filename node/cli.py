"""``gpuflex-node``: the volunteer's command line.

    gpuflex-node run --hub URL [--hub-key FPR] [--data-dir DIR] ...   contribute
    gpuflex-node bench [--device D] [--json]                         measure this machine
    gpuflex-node status | pause | resume                            drive the running node
    gpuflex-node id                                                 print this node's id

Exit codes: 0 done, 1 error, 2 usage, 3 hub key mismatch, 4 banned, 5 protocol mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import NodeError
from .files import software_version

if TYPE_CHECKING:
    from .agent import NodeAgent

EXIT_ERROR = 1
EXIT_KEY_MISMATCH = 3


def default_data_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("gpuflex-node", appauthor=False))


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()


def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", metavar="DIR", help="identity, cache, pin and control files "
                   "(default: the platform's user data folder)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuflex-node",
        description="Contribute this machine's GPU or CPU to GPUFlex training jobs.",
    )
    parser.add_argument("--version", action="version", version=f"gpuflex-node {software_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="register with a hub and train assignments until stopped")
    run.add_argument("--hub", required=True, metavar="URL", help="hub base URL, e.g. https://hub.example:8470")
    run.add_argument("--hub-key", metavar="FINGERPRINT",
                     help="the hub key fingerprint to trust (gf1-...); default: trust on first use")
    run.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda:N, mps")
    _add_data_dir(run)
    run.add_argument("--max-cache-gb", type=float, default=20.0, metavar="N", help="cache size cap (default 20)")
    run.add_argument("--threads", type=int, metavar="N", help="CPU threads for training "
                     "(torch.set_num_threads; default on a CPU: half the cores, at least 1)")
    run.add_argument("--max-gpu-memory", type=float, metavar="GB", help="cap this process's GPU memory")
    run.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                     help="train in fp32 (default) or under bf16 autocast (fp32 master weights); committed to in "
                          "every update, and the hub's referee re-executes in it")
    run.add_argument("--onednn", action=argparse.BooleanOptionalAction, default=True,
                     help="use oneDNN (mkldnn) CPU kernels (default on; --no-onednn uses torch's own)")
    run.add_argument("--yield-gpu", action=argparse.BooleanOptionalAction, default=True,
                     help="pause while another process uses the GPU (needs nvidia-ml-py; default on)")
    run.add_argument("--once", action="store_true", help="exit after one assignment")
    run.add_argument("--max-assignments", type=int, metavar="N", help="exit after N assignments")
    run.add_argument("--poll-wait", type=float, default=30.0, metavar="S", help="long-poll wait (<= 60 s)")
    run.add_argument("--heartbeat", type=float, default=5.0, metavar="S", help="heartbeat interval while working")
    run.add_argument("--json", action="store_true", help="JSON lines even on a terminal")
    run.add_argument("--no-control", action="store_true", help="do not serve the local control endpoint")
    run.add_argument("--bench-cache", metavar="PATH", help="benchmark cache file shared by the nodes of "
                     "this machine (default $GPUFLEX_BENCH_CACHE, else DIR/bench.json)")

    bench = sub.add_parser("bench", help="measure this machine (cached per hardware)")
    bench.add_argument("--device", default="auto")
    _add_data_dir(bench)
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--force", action="store_true", help="measure again even if cached")
    bench.add_argument("--threads", type=int, metavar="N", help="CPU threads (as `run --threads N` will use)")
    bench.add_argument("--bench-cache", metavar="PATH", help="cache file (default $GPUFLEX_BENCH_CACHE, "
                       "else DIR/bench.json)")

    for name, text in (("status", "show the running node's state"),
                       ("pause", "pause the running node (abandons the assignment in hand)"),
                       ("resume", "resume the running node")):
        p = sub.add_parser(name, help=text)
        _add_data_dir(p)
        p.add_argument("--json", action="store_true", help="print raw JSON")

    ident = sub.add_parser("id", help="print this node's id (its key fingerprint; read only: "
                           "the first `run` creates the key)")
    _add_data_dir(ident)
    return parser


def _cmd_run(args: argparse.Namespace, agent_cls: type[NodeAgent] | None = None) -> int:
    from .output import Output

    output = Output(json_lines=True if args.json else None)
    with output.status("loading torch…"):
        from .agent import NodeAgent, NodeConfig
    if not 0 < args.poll_wait <= 60:
        raise NodeError("--poll-wait must be in (0, 60] seconds")
    if args.max_cache_gb <= 0:
        raise NodeError("--max-cache-gb must be > 0")
    if args.max_assignments is not None and args.max_assignments < 1:
        raise NodeError("--max-assignments must be >= 1")
    config = NodeConfig(
        hub_url=args.hub, data_dir=_data_dir(args), hub_key=args.hub_key, device=args.device,
        max_cache_bytes=int(args.max_cache_gb * 1e9), threads=args.threads,
        max_gpu_memory_gb=args.max_gpu_memory, once=args.once, max_assignments=args.max_assignments,
        poll_wait_s=args.poll_wait, heartbeat_s=max(0.2, args.heartbeat), yield_gpu=args.yield_gpu,
        control=not args.no_control, bench_cache=Path(args.bench_cache) if args.bench_cache else None,
        precision=args.precision, onednn=args.onednn,
    )
    agent = (agent_cls or NodeAgent)(config, output=output)
    code = asyncio.run(agent.run())
    if agent.fatal is not None:
        print(f"gpuflex-node: error: {agent.fatal}", file=sys.stderr)
    return code


def _fmt_num(v: Any, unit: str) -> str:
    return "n/a" if v is None else f"{v:,.3g} {unit}"


@contextlib.contextmanager
def _bench_progress(path: Path) -> Iterator[Callable[[str, int, int], None]]:
    """Progress on stderr while the benchmark runs: a live bar on a terminal, else a line a step."""
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    print(f"measuring this machine (a few seconds; the result is cached in {path})", file=sys.stderr)
    if not console.is_terminal:
        def line(label: str, done: int, total: int) -> None:
            if done < total:
                print(f"  [{done + 1}/{total}] {label}", file=sys.stderr, flush=True)

        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        task = progress.add_task("benchmark", total=None)

        def bar(label: str, done: int, total: int) -> None:
            progress.update(task, description=label, completed=done, total=total)

        yield bar


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("loading torch…") if console.is_terminal else contextlib.nullcontext():
        from .benchmark import cache_path, load_cached, measure_and_cache
        from .device import apply_limits, select_device

    device = select_device(args.device)
    apply_limits(device, threads=args.threads, max_gpu_memory_gb=None)
    path = cache_path(_data_dir(args), args.bench_cache)
    results = None if args.force else load_cached(device, path)
    if results is None or results.get("quick"):
        with _bench_progress(path) as on_step:
            results = measure_and_cache(device, path, on_step=on_step)
        results["cached"] = False
    else:
        results["cached"] = True
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    d = results["device"]
    lines = [
        f"device            {d['kind']}: {d['name']}  ({d['memory_bytes'] / 2**30:.1f} GiB, {d['threads']} threads, torch {d['torch']})",
        f"matmul fp32       {_fmt_num(results['matmul_tflops_fp32'], 'TFLOP/s')}",
        f"matmul bf16       {_fmt_num(results['matmul_tflops_bf16'], 'TFLOP/s')}",
        f"matmul fp16       {_fmt_num(results['matmul_tflops_fp16'], 'TFLOP/s')}",
        f"memory bandwidth  {_fmt_num(results['mem_bandwidth_gbs'], 'GB/s')}",
        f"host->device      {_fmt_num(results['h2d_gbs'], 'GB/s')}",
        f"device->host      {_fmt_num(results['d2h_gbs'], 'GB/s')}",
    ]
    for model, sps in results["training"].items():
        lines.append(f"train {model:<27} {sps:,.0f} samples/s")
    how = "cached result" if results["cached"] else f"measured in {results['duration_s']:.1f} s"
    lines.append(f"({how}; fingerprint {results['fingerprint']})")
    print("\n".join(lines))
    return 0


def _cmd_control(args: argparse.Namespace) -> int:
    from .control import call_control

    data_dir = _data_dir(args)
    if args.command == "status":
        result = call_control(data_dir, "GET", "/v1/status")
    else:
        result = call_control(data_dir, "POST", f"/v1/{args.command}")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    if args.command == "pause":
        print("paused: no new work; an assignment in hand was handed back to the hub"
              if result.get("changed") else "already paused")
        return 0
    if args.command == "resume":
        print("resumed: taking work again" if result.get("changed") else "was not paused")
        return 0
    a = result.get("assignment")
    t = result.get("totals", {})
    lines = [
        f"node       {result['node_id']}  (gpuflex {result['version']})",
        f"hub        {result['hub']}  key {result['hub_fingerprint'] or '(not yet pinned)'}",
        f"state      {result['state']}" + (f"  (paused: {result['pause_reason']})" if result["paused"] else ""),
        f"device     {result['device']}   last throughput {result['samples_per_s']:,.1f} samples/s",
        f"cache      {result['cache_bytes'] / 1e6:,.1f} MB of {result['cache_cap_bytes'] / 1e9:,.1f} GB",
    ]
    if a:
        lines.append(
            f"working on {a['assignment_id']} (job {a['job_id']} round {a['round']}): "
            f"{a['phase']} {a['progress'] * 100:.0f}%  {a['samples']} samples in {a['chunks']} chunks"
        )
    lines.append(
        f"totals     {t.get('uploaded', 0)} updates, {t.get('samples_trained', 0):,} samples, "
        f"{t.get('train_s', 0.0):,.1f} s training, {t.get('abandoned', 0)} abandoned, {t.get('rejected', 0)} rejected"
    )
    print("\n".join(lines))
    return 0


def _cmd_id(args: argparse.Namespace) -> int:
    """Print the node id; read only: the key is created by the first ``run``, never here."""
    from .identity import KEY_FILE, load_key

    data_dir = _data_dir(args)
    key = load_key(data_dir)
    if key is None:
        print(
            f"gpuflex-node: no identity yet: {data_dir / KEY_FILE} does not exist; the first "
            f"`gpuflex-node run{'' if args.data_dir is None else f' --data-dir {data_dir}'}` creates it",
            file=sys.stderr,
        )
        return EXIT_ERROR
    print(key.fingerprint)
    return 0


def main(argv: list[str] | None = None, *, agent_cls: type[NodeAgent] | None = None) -> int:
    """The CLI. ``agent_cls`` lets test tooling run ``run`` with a NodeAgent subclass."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr,
    )
    handlers = {"run": _cmd_run, "bench": _cmd_bench, "status": _cmd_control,
                "pause": _cmd_control, "resume": _cmd_control, "id": _cmd_id}
    try:
        if args.command == "run":
            return _cmd_run(args, agent_cls)
        return handlers[args.command](args)
    except NodeError as exc:
        print(f"gpuflex-node: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
