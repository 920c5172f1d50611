"""``gpuflex-node``: the volunteer's command line.

    gpuflex-node run --hub URL [--hub-key FPR] [--data-dir DIR] ...   contribute
    gpuflex-node bench [--device D] [--json]                         measure this machine
    gpuflex-node status | pause | resume                            drive the running node
    gpuflex-node id                                                 print this node's id
    gpuflex-node data add JOB PATH [--share-histogram] [--subset N]  attach a dataset that stays here
    gpuflex-node data list | data remove JOB                         this node's silos

Exit codes: 0 done, 1 error, 2 usage, 3 hub key mismatch, 4 banned, 5 protocol mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import HubKeyMismatch, NodeError
from .files import software_version

if TYPE_CHECKING:
    from .agent import NodeAgent

EXIT_ERROR = 1
EXIT_USAGE = 2  # as argparse exits on a malformed argument
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
    _add_run(sub)
    _add_bench(sub)
    for name, text in (("status", "show the running node's state"),
                       ("pause", "pause the running node (abandons the assignment in hand)"),
                       ("resume", "resume the running node")):
        p = sub.add_parser(name, help=text)
        _add_data_dir(p)
        p.add_argument("--json", action="store_true", help="print raw JSON")
    ident = sub.add_parser("id", help="print this node's id (its key fingerprint; read only: "
                           "the first `run` creates the key)")
    _add_data_dir(ident)
    _add_data(sub)
    return parser


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="register with a hub and train assignments until stopped")
    run.add_argument("--hub", required=True, metavar="URL", help="hub base URL, e.g. https://hub.example:8470")
    run.add_argument("--hub-key", metavar="FINGERPRINT",
                     help="the hub key fingerprint to trust (gf1-...); default: trust on first use")
    run.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda:N, mps")
    run.add_argument("--devices", metavar="LIST", help="train on several local devices, one worker process "
                     "each: all (every CUDA device), 0,1 (those CUDA devices) or cpu:N (N CPU workers); "
                     "instead of --device")
    run.add_argument("--offload", choices=("optimizer",), help="with --devices: keep the optimizer state in "
                     "host memory (refused when the host has no room for it)")
    _add_data_dir(run)
    run.add_argument("--max-cache-gb", type=float, default=20.0, metavar="N", help="cache size cap (default 20)")
    run.add_argument("--max-checkpoint-gb", type=float, default=2.0, metavar="N",
                     help="cap on the checkpoint states kept for the hub's referee (default 2; states past it "
                          "are declared unavailable when asked for, and that work is left out unverified)")
    run.add_argument("--threads", type=int, metavar="N", help="CPU threads for training "
                     "(torch.set_num_threads; default on a CPU: half the cores, at least 1)")
    run.add_argument("--max-gpu-memory", type=float, metavar="GB", help="cap this process's GPU memory")
    run.add_argument("--max-memory", metavar="SIZE", help="the memory this node offers a pipeline stage, e.g. 2GB,"
                     " 512MiB or 1.5GiB (default: what the device has free when the node starts)")
    run.add_argument("--stage-listen", metavar="HOST:PORT", help="accept other pipeline stages' tensors"
                     " directly on this address, which the hub passes on to them (it must be reachable from"
                     " the other nodes; default: none, every tensor goes through the hub's relay)")
    run.add_argument("--onednn", choices=("on", "off"), default="on",
                     help="torch's oneDNN (mkldnn) CPU kernels (default on); off is another compute class")
    run.add_argument("--precisions", metavar="LIST",
                     help="comma-separated precisions to offer, a subset of what the device trains "
                          "(fp32, tf32, bf16, fp16; default: all it supports)")
    run.add_argument("--compute-share", type=float, default=1.0, metavar="F",
                     help="compute at most this share of the time (0.05 to 1, default 1): after each piece of "
                          "training the node rests, and it offers the hub its speed times F")
    run.add_argument("--yield-gpu", action=argparse.BooleanOptionalAction, default=True,
                     help="pause while another process uses the GPU (needs nvidia-ml-py; default on)")
    run.add_argument("--once", action="store_true", help="exit after one assignment")
    run.add_argument("--max-assignments", type=int, metavar="N", help="exit after N assignments")
    run.add_argument("--poll-wait", type=float, default=30.0, metavar="S", help="long-poll wait (<= 60 s)")
    run.add_argument("--heartbeat", type=float, default=5.0, metavar="S", help="heartbeat interval while working")
    run.add_argument("--json", action="store_true", help="JSON lines even on a terminal")
    run.add_argument("--enroll-token", metavar="TOKEN", help="the enrollment token your hub operator gave you"
                     " (default $GPUFLEX_ENROLL_TOKEN); needed when the hub requires enrollment")
    run.add_argument("--source-address", metavar="IP", help="bind outgoing connections to this local address"
                     " (a machine with several addresses; the local test cluster puts nodes in distinct blocks)")
    run.add_argument("--no-control", action="store_true", help="do not serve the local control endpoint")
    run.add_argument("--bench-cache", metavar="PATH", help="benchmark cache file shared by the nodes of "
                     "this machine (default $GPUFLEX_BENCH_CACHE, else DIR/bench.json)")


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="measure this machine (cached per hardware)")
    bench.add_argument("--device", default="auto")
    _add_data_dir(bench)
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--force", action="store_true", help="measure again even if cached")
    bench.add_argument("--threads", type=int, metavar="N", help="CPU threads (as `run --threads N` will use)")
    bench.add_argument("--onednn", choices=("on", "off"), default="on", help="as `run --onednn` will use")
    bench.add_argument("--devices", metavar="LIST", help="measure the whole node on these devices, one worker "
                       "process each, as `run --devices LIST` trains (the figures the hub sizes its shards by)")
    bench.add_argument("--offload", choices=("optimizer",), help="with --devices: as `run --offload` will use")
    bench.add_argument("--bench-cache", metavar="PATH", help="cache file (default $GPUFLEX_BENCH_CACHE, "
                       "else DIR/bench.json)")


def _add_data(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = sub.add_parser("data", help="node-local data: datasets that stay on this node and train "
                          "node-local jobs (the hub never gets a row)")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    add = data_sub.add_parser("add", help="check a dataset against a node-local job and attach it; the hub "
                              "learns its blob id, size and sample count only")
    add.add_argument("job", metavar="JOB", help="the node-local job's id")
    add.add_argument("path", metavar="PATH", help=".npz (arrays x and y) or .csv (a header row with the "
                     "job's label column)")
    add.add_argument("--share-histogram", action="store_true",
                     help="also send the count of samples per label, when the job asks for it (default: not sent)")
    add.add_argument("--subset", "--max-samples", dest="subset", type=int, metavar="N",
                     help="keep N rows of the file (seeded: the same rows every time), for a file larger "
                          "than the job takes")
    add.add_argument("--hub", metavar="URL", help="hub base URL (default: the hub this node last "
                     "registered with, from DIR/hub.pin)")
    add.add_argument("--hub-key", metavar="FINGERPRINT",
                     help="the hub key fingerprint to trust (gf1-...); default: the pinned one")
    _add_data_dir(add)
    listing = data_sub.add_parser("list", help="the silos this node holds")
    _add_data_dir(listing)
    listing.add_argument("--json", action="store_true", help="print raw JSON")
    remove = data_sub.add_parser("remove", help="stop training a job's silo, delete its copy here and tell "
                                 "the hub to withdraw it (if the hub cannot be reached, the node tells it "
                                 "when it next assigns the silo)")
    remove.add_argument("job", metavar="JOB")
    remove.add_argument("--hub", metavar="URL", help="hub base URL (default: the pinned one, from DIR/hub.pin)")
    remove.add_argument("--hub-key", metavar="FINGERPRINT",
                        help="the hub key fingerprint to trust (gf1-...); default: the pinned one")
    _add_data_dir(remove)


def _cmd_run(args: argparse.Namespace, agent_cls: type[NodeAgent] | None = None) -> int:
    from .output import Output

    output = Output(json_lines=True if args.json else None)
    with output.status("loading torch…"):
        from .agent import NodeAgent, NodeConfig
        from .computeshare import check_share
    if not 0 < args.poll_wait <= 60:
        raise NodeError("--poll-wait must be in (0, 60] seconds")
    if args.max_cache_gb <= 0:
        raise NodeError("--max-cache-gb must be > 0")
    if args.max_checkpoint_gb <= 0:
        raise NodeError("--max-checkpoint-gb must be > 0")
    if args.max_assignments is not None and args.max_assignments < 1:
        raise NodeError("--max-assignments must be >= 1")
    _check_devices(args)
    precisions = _precisions(args.precisions)
    max_memory = None if args.max_memory is None else parse_size(args.max_memory, "--max-memory")
    stage_address = _stage_address(args.stage_listen)
    config = NodeConfig(
        hub_url=args.hub, data_dir=_data_dir(args), hub_key=args.hub_key, device=args.device,
        max_cache_bytes=int(args.max_cache_gb * 1e9), max_checkpoint_bytes=int(args.max_checkpoint_gb * 1e9),
        threads=args.threads,
        max_gpu_memory_gb=args.max_gpu_memory, once=args.once, max_assignments=args.max_assignments,
        poll_wait_s=args.poll_wait, heartbeat_s=max(0.2, args.heartbeat), yield_gpu=args.yield_gpu,
        control=not args.no_control, bench_cache=Path(args.bench_cache) if args.bench_cache else None,
        onednn=args.onednn == "on", precisions=precisions,
        enroll_token=args.enroll_token or os.environ.get("GPUFLEX_ENROLL_TOKEN", ""),
        source_address=args.source_address, max_memory_bytes=max_memory, stage_address=stage_address,
        devices=args.devices, offload=args.offload, compute_share=check_share(args.compute_share),
    )
    agent = (agent_cls or NodeAgent)(config, output=output)
    code = asyncio.run(agent.run())
    if agent.fatal is not None:
        print(f"gpuflex-node: error: {agent.fatal}", file=sys.stderr)
    return code


#: a size's unit -> bytes (decimal and binary prefixes; "B" alone is bytes)
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]+)\s*")


def parse_size(text: str, flag: str) -> int:
    """Bytes from a size like "2GB", "512MiB" or "1.5GiB" (a number and a unit of SIZE_UNITS,
    either case); NodeError naming ``flag`` for anything else, zero, or more than the protocol
    carries."""
    from gpuflex.protocol.messages import MAX_MEMORY_BYTES

    match = _SIZE_RE.fullmatch(text)
    unit = SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise NodeError(f"{flag} {text[:40]!r}: expected a size like 2GB, 512MiB or 1.5GiB"
                        " (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(match.group(1)) * unit
    size = int(value) if value <= MAX_MEMORY_BYTES else MAX_MEMORY_BYTES + 1  # inf too
    if not 0 < size <= MAX_MEMORY_BYTES:
        raise NodeError(f"{flag} {text[:40]!r}: must be more than 0 bytes and at most 1 PiB")
    return size


_WILDCARDS = {"0.0.0.0", "::", "*", ""}


def _stage_address(text: str | None) -> str:
    """--stage-listen as the "host:port" other stages connect to ("" when not given); NodeError
    for anything else, or a wildcard host (other nodes cannot connect to it)."""
    if text is None:
        return ""
    host, sep, port = text.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or len(text) > 128:
        raise NodeError(f"--stage-listen {text[:60]!r}: expected HOST:PORT (a port from 1 to 65535)")
    if bare in _WILDCARDS:
        raise NodeError(f"--stage-listen {text!r}: give the address other nodes reach this one at, "
                        "not a wildcard")
    return text


def _precisions(text: str | None) -> tuple[str, ...] | None:
    from gpuflex.protocol.messages import PRECISIONS

    if text is None:
        return None
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in chosen if p not in PRECISIONS]
    if bad or not chosen:
        raise NodeError(f"--precisions {text!r}: expected a comma-separated list of {', '.join(PRECISIONS)}")
    return chosen


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

    from .benchcache import cache_path, cached_on_cpu, full_result

    if args.threads is not None and args.threads < 1:
        raise NodeError("--threads must be >= 1")
    _check_devices(args)
    path = cache_path(_data_dir(args), args.bench_cache)
    # a CPU's cached result is found without torch (node/hostinfo.py); anything else loads it
    results = None if args.force or args.devices else cached_on_cpu(args.device, path, threads=args.threads,
                                                                    onednn=args.onednn == "on")
    if results is None:
        console = Console(stderr=True)
        with console.status("loading torch…") if console.is_terminal else contextlib.nullcontext():
            from .benchmark import load_cached, measure_and_cache
            from .device import set_onednn

        device, group = _bench_devices(args)
        set_onednn(args.onednn == "on")
        results = None if args.force else full_result(load_cached(device, path, group))
        if results is None:
            with _bench_progress(path) as on_step:
                results = measure_and_cache(device, path, on_step=on_step, group=group)
            results["cached"] = False
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    d = results["device"]
    lines = [
        f"device            {d['kind']}: {d['name']}  ({d['memory_bytes'] / 2**30:.1f} GiB, {d['threads']} threads, torch {d['torch']})",
        *([f"trained on        {len(results['workers'])} worker processes ({', '.join(results['workers'])}),"
           " the whole node: the training figures below are all of them together"] if results.get("workers") else []),
        f"matmul fp32       {_fmt_num(results['matmul_tflops_fp32'], 'TFLOP/s')}",
        f"matmul bf16       {_fmt_num(results['matmul_tflops_bf16'], 'TFLOP/s')}",
        f"matmul fp16       {_fmt_num(results['matmul_tflops_fp16'], 'TFLOP/s')}",
        f"memory bandwidth  {_fmt_num(results['mem_bandwidth_gbs'], 'GB/s')}",
        f"host->device      {_fmt_num(results['h2d_gbs'], 'GB/s')}",
        f"device->host      {_fmt_num(results['d2h_gbs'], 'GB/s')}",
    ]
    for model, sps in results["training"].items():
        lines.append(f"train {model:<27} {sps:,.0f} samples/s")
    reference = results.get("reference_model", "")
    for precision, sps in (results.get("precision_sps") or {}).items():
        lines.append(f"train {reference + ' ' + precision:<27} {sps:,.0f} samples/s")
    how = "cached result" if results["cached"] else f"measured in {results['duration_s']:.1f} s"
    lines.append(f"({how}; fingerprint {results['fingerprint']})")
    print("\n".join(lines))
    return 0


def _check_devices(args: argparse.Namespace) -> None:
    """``--device`` / ``--devices`` / ``--offload`` as `run` and `bench` take them: one line each."""
    if args.devices is not None and args.device != "auto":
        raise NodeError("--device and --devices: give one of them")
    if args.offload is not None and args.devices is None:
        raise NodeError("--offload needs --devices (the offloaded state is the workers')")


def _bench_devices(args: argparse.Namespace) -> tuple[Any, Any]:
    """The device the bench measures and, with ``--devices``, the node's worker group."""
    import torch

    from .device import apply_limits, select_device
    from .devices import worker_group

    if args.devices is None:
        device = select_device(args.device)
        apply_limits(device, threads=args.threads, max_gpu_memory_gb=None)
        return device, None
    apply_limits(torch.device("cpu"), threads=args.threads, max_gpu_memory_gb=None)
    return worker_group(args.devices, offload=args.offload, work_dir=_data_dir(args) / "devices",
                        max_memory_bytes=None, threads=torch.get_num_threads())


def _pause_line(result: dict[str, Any]) -> str:
    """What `gpuflex-node pause` did, as the node reported it (node/control.py)."""
    if not result.get("changed"):
        return "already paused"
    held = result.get("assignment")
    if not held:
        return "paused: no new work (no assignment was in hand)"
    aid = held.get("assignment_id")
    return "paused: no new work; " + {
        "handed_back": f"assignment {aid} was handed back to the hub (another node takes its shard)",
        "not_told": f"assignment {aid} was dropped, but the hub could not be told: it takes the shard back"
                    " when the assignment's deadline passes",
        "ended": f"assignment {aid} had already finished",
    }.get(held.get("outcome"), f"assignment {aid} is being handed back to the hub")


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
        print(_pause_line(result))
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
        f"device     {result['device']}   last throughput {result['samples_per_s']:,.1f} samples/s"
        + (f"   computing {share:.0%} of the time" if (share := result.get("compute_share", 1.0)) < 1 else ""),
        f"class      {_class_line(result.get('compute_class') or {})}",
        f"cache      {result['cache_bytes'] / 1e6:,.1f} MB of {result['cache_cap_bytes'] / 1e9:,.1f} GB",
    ]
    for precision, key in (result.get("class_keys") or {}).items():
        lines.append(f"class key  {precision}: {key}")
    if a:
        lines.append(
            f"working on {a['assignment_id']} (job {a['job_id']} round {a['round']}, {a.get('precision', 'fp32')}): "
            f"{a['phase']} {a['progress'] * 100:.0f}%  {a['samples']} samples in {a['chunks']} chunks"
        )
    lines.append(
        f"totals     {t.get('uploaded', 0)} updates, {t.get('samples_trained', 0):,} samples, "
        f"{t.get('train_s', 0.0):,.1f} s training, {t.get('abandoned', 0)} abandoned, {t.get('rejected', 0)} rejected"
    )
    print("\n".join(lines))
    return 0


def _class_line(c: dict[str, Any]) -> str:
    """One line for a compute class (the dict of ``NodeAgent.status()['compute_class']``)."""
    if not c:
        return "unknown"
    if c.get("device_kind") == "cuda":
        where = f"{c.get('device_model')} (sm {c.get('capability')}, CUDA {c.get('cuda')}, cuDNN {c.get('cudnn')})"
    elif c.get("device_kind") == "cpu":
        isa = " ".join(c.get("isa") or []) or "no vector ISA flags"
        where = (f"{c.get('device_model')} ({c.get('cpu_vendor')}: {isa}; oneDNN "
                 f"{'on' if c.get('onednn') else 'off'}, {c.get('threads')} threads)")
    else:
        where = str(c.get("device_model"))
    return f"{c.get('device_kind')} {where}, torch {c.get('torch')}; trains {', '.join(c.get('precisions') or [])}"


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


def _hub_url(data_dir: Path, given: str | None) -> str:
    """--hub, else the URL of the hub pinned in DIR/hub.pin (the last one `run` registered with)."""
    from .errors import ConfigError
    from .identity import PIN_FILE

    url = given
    if url is None:
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            url = str(json.loads((data_dir / PIN_FILE).read_text(encoding="utf-8")).get("url") or "") or None
    if url is None:
        raise ConfigError(f"no hub URL: pass --hub URL (no hub pinned in {data_dir / PIN_FILE} yet)")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--hub {url!r}: expected an http:// or https:// URL")
    return url


def _cmd_data(args: argparse.Namespace) -> int:
    if args.data_command == "add":
        return _cmd_data_add(args)
    if args.data_command == "list":
        return _cmd_data_list(args)
    return _cmd_data_remove(args)


def _cmd_data_add(args: argparse.Namespace) -> int:
    """Fetch the job's schema, check the file here, store it, register it; print what left the
    node. Any failure leaves the silo index as it was (the blob is written, registered, and only
    then committed; a refused one is deleted)."""
    from gpuflex.protocol.dataset import DatasetError, check_dataset_file
    from gpuflex.protocol.errors import ProtocolError
    from gpuflex.protocol.messages import ID_RE

    from .errors import ConfigError
    from .identity import KEY_FILE, load_key
    from .silos import SiloError

    data_dir = _data_dir(args)
    path = Path(args.path).expanduser()
    if args.subset is not None and args.subset < 1:
        raise ConfigError(f"--subset {args.subset}: must be at least 1")
    try:
        check_dataset_file(path, "silo")  # before any request: a missing file needs no hub
    except DatasetError as exc:
        raise SiloError(str(exc), code=exc.code) from None
    key = load_key(data_dir)
    if key is None:
        raise ConfigError(
            f"no identity yet: {data_dir / KEY_FILE} does not exist; start `gpuflex-node run --hub URL"
            f"{'' if args.data_dir is None else f' --data-dir {data_dir}'}` once so the hub knows this node, "
            "then add the data"
        )
    if ID_RE.fullmatch(args.job) is None:
        raise ConfigError(f"JOB {args.job[:80]!r}: not a job id (letters, digits, _ and -; at most 64)")
    hub_url = _hub_url(data_dir, args.hub)
    try:
        lines = asyncio.run(_data_add(args, data_dir, key, hub_url, path.resolve()))
    except ProtocolError as exc:
        raise NodeError(f"data add: {exc}") from None
    except OSError as exc:
        raise NodeError(f"data add: cannot write the silo under {data_dir / 'silos'}: {exc}") from None
    print("\n".join(lines))
    return 0


async def _pinned_client(session: Any, data_dir: Path, key: Any, hub_url: str, hub_key: str | None) -> Any:
    """A HubClient for the `data` commands: the hub's key checked against the pin (or --hub-key),
    its protocol version matched, and its clock taken (they sign before any registration)."""
    from gpuflex.protocol.version import PROTOCOL_VERSION

    from .client import HubClient
    from .errors import HubError
    from .identity import check_hub_key

    client = HubClient(hub_url, key, session)
    public_key, claimed, proto = await client.hub_info()
    pin = check_hub_key(data_dir, hub_url, public_key, claimed, hub_key)
    if proto != PROTOCOL_VERSION:
        raise HubError(f"hub speaks protocol {proto}, this node {PROTOCOL_VERSION}; upgrade the older side",
                       code="version_mismatch")
    client.hub_public_key = pin.public_key
    return client


async def _data_add(args: argparse.Namespace, data_dir: Path, key: Any, hub_url: str, path: Path) -> list[str]:
    import aiohttp
    from gpuflex.protocol.messages import MAX_LIST
    from gpuflex.protocol.modelspec import ModelSpec

    from .errors import HubError, UnknownNode
    from .silos import SiloError, SiloStore, label_histogram, load_silo

    job = args.job
    async with aiohttp.ClientSession() as session:
        client = await _pinned_client(session, data_dir, key, hub_url, args.hub_key)
        try:
            schema = await client.silo_schema(job)
        except UnknownNode:
            raise HubError(f"the hub at {hub_url} does not know this node yet: start `gpuflex-node run` once "
                           "so it registers, then add the data", code="unknown_node") from None
        arrays = await asyncio.to_thread(load_silo, path, schema, keep=args.subset)
        spec = ModelSpec.from_dict(schema.model_spec)  # load_silo built it already: valid
        histogram: tuple[int, ...] = ()
        if not schema.label_histogram:
            shared = "not shared (the job does not ask for it)"
        elif not args.share_histogram:
            shared = "not shared (the job asks for it; pass --share-histogram to send it)"
        elif spec.task != "classification" or spec.outputs > MAX_LIST:
            shared = "not shared (the job's labels are not classes this node can count)"
        else:
            histogram = label_histogram(arrays, spec.outputs)
            shared = f"shared: {len(histogram)} counts, one per label"
        store = SiloStore(data_dir / "silos")
        before = store.get(job)
        blob = await asyncio.to_thread(store.write_blob, arrays)
        try:
            ack = await client.register_silo(job, blob.sha256, blob.size, blob.samples, histogram)
            if not ack.ok:
                raise SiloError(f"the hub refused the silo for job {job}: {ack.detail or 'no reason given'}",
                                code="refused")
        except UnknownNode:
            store.drop_blob(blob.sha256)
            raise HubError(f"the hub at {hub_url} does not know this node yet: start `gpuflex-node run` once "
                           "so it registers, then add the data", code="unknown_node") from None
        except BaseException:
            store.drop_blob(blob.sha256)
            raise
        record = store.commit(job, blob, path, bool(histogram))
    lines = [
        f"job        {job}",
        f"samples    {record.samples}" + (f" (--subset {args.subset} of the file's rows)" if args.subset else ""),
        f"blob id    {record.sha256} ({record.size:,} bytes, kept 0600 in {store.root})",
        f"histogram  {shared}",
    ]
    if before is not None and before.sha256 != record.sha256:
        lines.append(f"replaces   the silo {before.sha256[:12]}… this node held for the job")
    lines.append("Nothing else about the rows left this node: the hub got the blob id, its size and the sample "
                 f"count{' and the label histogram' if histogram else ''}. The node trains it when the hub "
                 "assigns it, from this disk.")
    return lines


def _cmd_data_list(args: argparse.Namespace) -> int:
    from datetime import datetime

    from .silos import SiloStore

    records = SiloStore(_data_dir(args) / "silos").records()
    if args.json:
        print(json.dumps({"silos": [dataclasses.asdict(r) for r in records]}, indent=1))
        return 0
    if not records:
        print("no silos on this node (attach one: gpuflex-node data add JOB PATH)")
        return 0
    rows = [("job", "samples", "bytes", "blob id", "histogram", "added", "source")]
    for r in records:
        added = datetime.fromtimestamp(r.added_at).strftime("%Y-%m-%d %H:%M")
        rows.append((r.job_id, f"{r.samples:,}", f"{r.size:,}", r.sha256[:16] + "…",
                     "shared" if r.histogram_shared else "not shared", added, r.source))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    return 0


def _cmd_data_remove(args: argparse.Namespace) -> int:
    """Remove the silo here first (the operator's data leaves this node's store whatever the hub
    says), then ask the hub to withdraw it. An unreachable hub is told later, by the node."""
    from .silos import SiloError, SiloStore

    data_dir = _data_dir(args)
    store = SiloStore(data_dir / "silos")
    record = store.remove(args.job)
    if record is None:
        raise SiloError(f"no silo for job {args.job} on this node (see gpuflex-node data list)", code="no_silo")
    print(f"removed the silo of job {record.job_id} ({record.samples:,} samples, blob {record.sha256[:12]}…) "
          "from this node: it no longer trains it and refuses assignments that name it")
    print(_withdraw_at_hub(args, data_dir, record.job_id, record.sha256))
    print(f"your file {record.source} is untouched")
    return 0


def _withdraw_at_hub(args: argparse.Namespace, data_dir: Path, job_id: str, sha256: str) -> str:
    """One line: what the hub said to the withdrawal, or why it was not told."""
    import aiohttp
    from gpuflex.protocol.errors import ProtocolError

    from .errors import HubError
    from .identity import load_key

    try:
        key = load_key(data_dir)
        if key is None:
            return f"the hub was not told: this node has no identity in {data_dir}"
        hub_url = _hub_url(data_dir, args.hub)

        async def withdraw() -> str:
            async with aiohttp.ClientSession() as session:
                client = await _pinned_client(session, data_dir, key, hub_url, args.hub_key)
                return str((await client.withdraw_silo(job_id, sha256)).detail)

        detail = asyncio.run(withdraw())
    except HubKeyMismatch:
        raise
    except (NodeError, ProtocolError, OSError, aiohttp.ClientError, TimeoutError) as exc:
        if isinstance(exc, HubError) and exc.code == "unknown_job":
            return f"the hub runs no job {job_id}: nothing to withdraw there"
        return (f"the hub was not told ({' '.join(str(exc).split())[:200]}); the node tells it the next time "
                "the hub assigns this silo")
    return f"the hub withdrew it: {detail}"


def _bad_hub_key(text: str | None) -> str | None:
    """Why ``--hub-key`` is not written as a key fingerprint, or None (it is, or was not given)."""
    if text is None:
        return None
    from gpuflex.protocol.signing import is_fingerprint

    if is_fingerprint(text.strip().lower()):
        return None
    shown = text[:60].encode("ascii", "backslashreplace").decode()
    return (f"--hub-key must be a hub key fingerprint like gf1-abcd-efgh-ijkl-mnop-qrst (ask the hub operator),"
            f" not {shown!r}")


def main(argv: list[str] | None = None, *, agent_cls: type[NodeAgent] | None = None) -> int:
    """The CLI. ``agent_cls`` lets test tooling run ``run`` with a NodeAgent subclass."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr,
    )
    handlers = {"run": _cmd_run, "bench": _cmd_bench, "status": _cmd_control,
                "pause": _cmd_control, "resume": _cmd_control, "id": _cmd_id, "data": _cmd_data}
    bad_key = _bad_hub_key(getattr(args, "hub_key", None))
    if bad_key is not None:  # a typo, not an impersonation: said before a benchmark or a hub is asked
        print(f"gpuflex-node: error: {bad_key}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "run":
            return _cmd_run(args, agent_cls)
        return handlers[args.command](args)
    except HubKeyMismatch as exc:
        print(f"gpuflex-node: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_KEY_MISMATCH
    except NodeError as exc:
        print(f"gpuflex-node: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
