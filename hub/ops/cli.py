"""`gpuflex-hub`: serve, tokens, and the owner's job commands.

Other areas add subcommands (`audit ...`, `demo`) without editing this file: a
module listed in PLUGIN_MODULES that exists and defines
`register(subparsers: argparse._SubParsersAction) -> None` gets called; each
parser it adds must `set_defaults(func=callable(args) -> int)`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import ipaddress
import json
import os
import signal
import ssl
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import owner_client as oc
from .cli_common import ENV_HUB, ENV_TOKEN, _hub_and_token, print_columns
from .cli_pipeline import print_pipeline_status
from .cli_plan import cmd_job_plan
from .cli_rollback import add_rollback, rollback_notes
from .owner_client import OwnerClientError

if TYPE_CHECKING:
    from aiohttp import web

    from ..base.config import HubConfig

PLUGIN_MODULES = ("gpuflex.hub.ops.cli_audit", "gpuflex.hub.ops.cli_cooldown", "gpuflex.hub.ops.demo")


def _software_version() -> str:
    """The package version without importing gpuflex.protocol (which pulls in torch): keeps --help fast."""
    from importlib import metadata

    try:
        return metadata.version("gpuflex")
    except metadata.PackageNotFoundError:
        return "0.0.0+source"


# -- serve ---------------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _serve_config(args: argparse.Namespace) -> HubConfig | None:
    """serve's options as the hub's config; None (with one line on stderr) for a bad pair of them.
    A bad store URL or S3 option raises its one-line error before anything is created."""
    from ..base.config import HubConfig

    if bool(args.tls_cert) != bool(args.tls_key):
        print("error: give both --tls-cert and --tls-key", file=sys.stderr)
        return None
    if not 0 <= args.body_idle_timeout < float("inf"):
        print(f"error: --body-idle-timeout must be a number of seconds, 0 or more (got {args.body_idle_timeout})",
              file=sys.stderr)
        return None
    if not 0 < args.stage_timeout < float("inf"):
        print(f"error: --stage-timeout must be a number of seconds above 0 (got {args.stage_timeout})",
              file=sys.stderr)
        return None
    if args.store is not None:
        from ..storage.store_postgres import check_url

        check_url(args.store)  # a bad URL: one line, before anything is created
    from ..storage.blobs import check_s3_options

    check_s3_options(args.blobs, args.s3_endpoint, args.s3_region)  # likewise
    return HubConfig(
        data_dir=Path(args.data), store=args.store, host=args.host, port=args.port,
        blobs=args.blobs, s3_endpoint=args.s3_endpoint, s3_region=args.s3_region,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        long_poll_max_s=args.long_poll_max, min_deadline_s=args.min_deadline,
        require_enrollment=args.require_enrollment, separate_replicas=not args.allow_shared_blocks,
        ipv4_block_prefix=args.ipv4_block_prefix, ipv6_block_prefix=args.ipv6_block_prefix,
        registrations_per_block=args.registrations_per_block, registrations_global=args.registrations_global,
        trust_min_age_s=args.trust_min_age, unproven_max_chunks=args.unproven_max_chunks,
        body_idle_timeout_s=args.body_idle_timeout, stage_timeout_s=args.stage_timeout,
    )


async def _serve(args: argparse.Namespace) -> int:
    from ..server.app import create_app
    from ..server.appkeys import FIRST_ADMIN_TOKEN, HUB_KEY

    config = _serve_config(args)
    if config is None:
        return 2
    from .openfiles import open_files_warning, raise_open_files

    warning = open_files_warning(raise_open_files())
    if warning and args.worker_index in (None, 0):
        print(warning, file=sys.stderr, flush=True)
    ssl_ctx = None
    if config.tls_cert and config.tls_key:
        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_ctx.load_cert_chain(config.tls_cert, config.tls_key)
    elif not _is_loopback(config.host) and args.worker_index in (None, 0):
        print(f"WARNING: binding {config.host} without TLS: tokens and data travel in clear text. "
              "Use --tls-cert/--tls-key or a TLS-terminating proxy.", file=sys.stderr, flush=True)
    if args.worker_fd is not None:  # one of `serve --workers N`'s processes (hub/server/workers.py)
        from ..server.workers import run_worker

        return await run_worker(config, ssl_ctx, args.worker_fd, args.worker_index or 0)
    lease = None
    if config.store is not None:  # one hub leads a PostgreSQL database (hub/storage/lease.py)
        from ..storage.lease import Lease, fence

        lease = Lease(config.store, "gpuflex-hub").acquire()
    app = create_app(config, lease=lease)
    if lease is not None:
        lease.watch(fence)  # a leader that cannot see its lease any more stops at once
    print(f"hub key fingerprint: {app[HUB_KEY].fingerprint}", flush=True)
    if app[FIRST_ADMIN_TOKEN]:
        print(f"admin token (shown once): {app[FIRST_ADMIN_TOKEN]}", flush=True)
    await _run_until_signalled(app, config, ssl_ctx)
    return 0


async def _run_until_signalled(app: web.Application, config: HubConfig, ssl_ctx: ssl.SSLContext | None) -> None:
    """Listen, write the hub's URL to its file, and serve until SIGTERM or SIGINT."""
    from aiohttp import web

    from ..server.heap import settle_heap

    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=10.0)
    await runner.setup()
    settle_heap()  # start-up done: its objects leave the collector's walks (hub/server/heap.py)
    site = web.TCPSite(runner, config.host, config.port, ssl_context=ssl_ctx, reuse_address=True)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    port = sockets[0].getsockname()[1] if sockets else config.port
    scheme = "https" if ssl_ctx else "http"
    host = config.host if ":" not in config.host else f"[{config.host}]"
    url = f"{scheme}://{host}:{port}"
    tmp = config.url_path.with_suffix(".tmp")
    tmp.write_text(url + "\n")
    os.replace(tmp, config.url_path)
    print(f"gpuflex-hub listening on {url}", flush=True)
    print(f"web console: {url}/console/ (log in with a token)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        print("gpuflex-hub shutting down", flush=True)
        await runner.cleanup()


def cmd_serve(args: argparse.Namespace) -> int:
    if args.worker_fd is None and args.workers != 1:
        from ..server.workers import check, supervise

        check(args.workers, args.store, Path(args.data))  # one line, before anything starts
        if args.store is not None:
            from ..storage.store_postgres import check_url

            check_url(args.store)
        Path(args.data).mkdir(parents=True, exist_ok=True)
        return supervise(args.argv, args.workers, args.host, args.port, Path(args.data),
                         "https" if args.tls_cert else "http")
    return asyncio.run(_serve(args))


# -- tokens --------------------------------------------------------------------------------------


def cmd_token_create(args: argparse.Namespace) -> int:
    from ..storage.token_admin import create_token

    print(create_token(Path(args.data), args.role, args.name, store=args.store))
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    from ..storage.token_admin import list_tokens

    for t in list_tokens(Path(args.data), store=args.store):
        state = "revoked" if t["revoked_at"] else "live"
        created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(t["created_at"])))  # type: ignore[arg-type]
        print(f"{t['id']:>4}  {t['role']:<8} {t['name']:<24} {created}  {state}")
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    from ..storage.token_admin import revoke_token

    revoke_token(Path(args.data), args.id, store=args.store)
    print(f"token {args.id} revoked")
    return 0


# -- output --------------------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    """Move the hub's state from SQLite in --data to the PostgreSQL database --to (hub/storage/migrate.py)."""
    from ..storage.migrate import migrate
    from ..storage.store_postgres import redact

    data = Path(args.data)
    copies = migrate(data, args.to, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print_columns(["table", "rows", "verified"], [[c.table, str(c.rows), "count + digest"] for c in copies],
                  title=f"{data} -> {redact(args.to)}")
    print(f"done: start the hub with --data {data} --store <that URL>; the SQLite database is kept as"
          f" {data / 'hub.sqlite3.migrated'}")
    return 0


# -- owner client --------------------------------------------------------------------------------


def _check_spec_file(path: Path) -> None:
    from ..base.errors import Unprocessable

    if not path.exists():
        raise Unprocessable(f"spec {path}: no such file")
    if path.is_dir():
        raise Unprocessable(f"spec {path}: is a directory; give the job's .toml file")
    if path.suffix.lower() != ".toml":
        raise Unprocessable(f"spec {path}: a job spec is a .toml file (see docs/job-spec.md)")


def cmd_job_submit(args: argparse.Namespace) -> int:
    import tempfile

    spec, val = Path(args.spec), Path(args.val) if args.val else None
    train = Path(args.train) if args.train else None
    _check_spec_file(spec)
    with tempfile.TemporaryDirectory(prefix="gpuflex-submit-") as tmp:
        train = _dataset_file(train, spec, Path(tmp), "--train")
        val = _dataset_file(val, spec, Path(tmp), "--val")
        hub, token = _hub_and_token(args)
        base = Path(args.base) if args.base else None
        doc = asyncio.run(oc.submit_job(hub, token, spec, train, val, base=base))
    print(json.dumps(doc) if args.json else doc["id"])
    return 0


def _dataset_file(path: Path | None, spec: Path, tmp: Path, what: str) -> Path | None:
    """``path`` checked for upload; a language model's UTF-8 text (.txt) is first cut into
    token windows by the spec's context and written as an .npz in ``tmp``."""
    from ..policy.datafiles import check_dataset_file, is_text_file, text_as_npz, text_context

    if path is None:
        return None
    context = text_context(spec.read_bytes(), what) if is_text_file(path) else None
    if context is None:
        check_dataset_file(path, what)
        return path
    return text_as_npz(path, context, tmp / f"{what.strip('-')}.npz", what)


def cmd_job_list(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    jobs = asyncio.run(oc.list_jobs(hub, token))
    if args.json:
        print(json.dumps({"jobs": jobs}))
        return 0
    print_columns(("id", "name", "owner", "state", "round"),
                  [(j["id"], j["name"], j["owner"], j["state"], f"{j['round']}/{j['rounds']}") for j in jobs],
                  title=f"{len(jobs)} job(s)")
    return 0


def _notes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The status's lines below its first: (key, value) pairs, the same in both layouts."""
    return _round_notes(doc) + rollback_notes(doc) + _job_notes(doc)


def _round_notes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The live round's progress, why nodes idle, an error, and how the data was cut."""
    out: list[tuple[str, str]] = []
    prog = doc.get("progress") or {}
    if prog:
        out.append(("progress", f"chunks {prog['chunks_covered']}/{prog['chunks_total']} covered,"
                                f" {prog['assignments_live']} assignments live"))
    if prog.get("idle"):
        out.append(("idle nodes", str(prog["idle"])))
    if doc.get("error"):
        out.append(("error", str(doc["error"])))
    for why in doc.get("waiting") or ():  # why the open round waits, and how to fix it (hub/domain/waits.py)
        out.append(("waiting", str(why)))
    data = doc.get("data") or {}
    if data.get("chunks"):
        out.append(("data", f"{doc.get('train_samples')} training samples in {data['chunks']} chunks of up to"
                            f" {data['chunk_size']}"))
    if data.get("validation"):
        out.append(("validation", str(data["validation"])))
    return out


def _job_notes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """How the job's rounds were spread, its privacy, its silos and what its owner is not shown."""
    out: list[tuple[str, str]] = []
    par = doc.get("parallel") or {}
    if par.get("rounds"):
        out.append(("spread", f"{par['shards']:.1f} shards and {par['nodes']:.1f} nodes a round on average;"
                              f" parallel efficiency {par['efficiency']:.0%} (training time summed over the nodes /"
                              " (nodes x round wall time))"))
    dp = doc.get("privacy")
    if dp:  # [privacy] dp = "central" (hub/policy/privacy.py)
        eps = "inf (no noise)" if dp["epsilon"] is None else f"{dp['epsilon']:.3g}"
        end = "inf" if dp["epsilon_at_end"] is None else f"{dp['epsilon_at_end']:.3g}"
        out.append(("privacy", f"ε = {eps} at δ = {dp['delta']:g} after {dp['rounds']} rounds"
                               f" ({dp['mechanism']}: clip {dp['clip_norm']:g}, noise multiplier"
                               f" {dp['noise_multiplier']:g}; ε = {end} after all {doc['rounds']})"))
    silos = doc.get("silos")
    if silos is not None:  # [data] source = "node-local": what the hub knows of each silo
        counts = [s["samples"] for s in silos]
        total = f", {sum(counts)} samples in all" if None not in counts else ""
        out.append(("silos", f"{len(silos)} attached{total} (the rows stay on their nodes)"))
    if doc.get("redacted"):  # what the job's [privacy] option keeps from its owner (readmodel.redaction.owner_view)
        out.append(("not shown", str(doc["redacted"])))
    return out


ROUND_COLUMNS = ("round", "val loss", "accuracy", "train loss", "shards", "nodes: share of samples",
                 "efficiency", "updates", "flags", "MB up / down", "compression")


def _fmt(v: Any, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def _round_cells(h: dict[str, Any]) -> list[str]:
    """One closed round's values, in ROUND_COLUMNS' order; the node shares one per line."""
    shares = h.get("node_shares") or {}
    share_text = "\n".join(f"{n} {v:.0%}" for n, v in sorted(shares.items(), key=lambda kv: -kv[1]))
    p = h.get("parallel") or {}
    unverified = len(h.get("unverified") or {})
    t = h.get("transfer") or {}
    down = t.get("bytes_down")
    return [str(h["round"]), _fmt(h["loss"]), _fmt(h["accuracy"], ".3f"), _fmt(h["train_loss"]),
            str(p.get("shards", "-")), share_text or "-", _fmt(p.get("efficiency"), ".0%"),
            str(sum(1 for u in h["updates"] if u["status"] == "included"))
            + (f" ({unverified} unverified)" if unverified else ""), str(len(h["flags"])),
            f"{t.get('bytes_up', 0) / 1e6:.2f} / " + ("-" if down is None else f"{down / 1e6:.2f}"),
            _fmt(t.get("compression_ratio"), ".1f") + "x" if t.get("compression_ratio") else "-"]


def _status_view(doc: dict[str, Any]) -> Any:
    """The status for a wide terminal: a heading and one table row per closed round."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"{doc['id']}  {doc['name']}  state={doc['state']}  round {doc['round']}/{doc['rounds']}")
    for key, value in _notes(doc):
        sep = "  " if key == "progress" else "\n"
        head.append(f"{sep}{value}" if key == "progress" else f"{sep}{key}: {value}",
                    style="red" if key == "error" else "")
    table = Table(*ROUND_COLUMNS)
    for h in doc["history"]:
        table.add_row(*_round_cells(h))
    return Group(head, table)


def _status_lines(doc: dict[str, Any]) -> list[str]:
    """The status as plain "key: value" lines, every value whole: for a pipe or a terminal too
    narrow for the table (ids are copied from here into the next command)."""
    lines = [f"id: {doc['id']}", f"name: {doc['name']}", f"state: {doc['state']}",
             f"round: {doc['round']}/{doc['rounds']}"]
    lines += [f"{key}: {value}" for key, value in _notes(doc)]
    for h in doc["history"]:
        cells = _round_cells(h)
        lines.append(f"round {cells[0]}:")
        lines += [f"  {key}: {value.replace(chr(10), ', ')}" for key, value in zip(ROUND_COLUMNS[1:], cells[1:],
                                                                                      strict=True)]
    return lines


def _fits(console: Any, view: Any) -> bool:
    """Does the table layout show every value whole here: a terminal at least as wide as it?"""
    from rich.measure import Measurement

    if not console.is_terminal:
        return False
    unbounded = console.options.update_width(1 << 20)  # a measurement is clamped to the width it is given
    return bool(Measurement.get(console, unbounded, view).maximum <= console.width)


def cmd_job_status(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    doc = asyncio.run(oc.job_status(hub, token, args.id))
    if args.json:
        print(json.dumps(doc))
        return 0
    if "pipeline" in doc:  # a pipelined job has no rounds: its pipeline is its progress
        return print_pipeline_status(doc, args, hub, token)
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not _fits(console, _status_view(doc)):
        return _plain_status(doc, args, hub, token)
    if not args.watch:
        console.print(_status_view(doc))
        return 0
    with Live(_status_view(doc), console=console, refresh_per_second=2) as live:
        while doc["state"] in ("queued", "running"):
            time.sleep(args.interval)
            doc = asyncio.run(oc.job_status(hub, token, args.id))
            live.update(_status_view(doc))
    return 0


def _plain_status(doc: dict[str, Any], args: argparse.Namespace, hub: str, token: str) -> int:
    """The plain layout; --watch prints it again, after a blank line, each time it changes."""
    shown = _status_lines(doc)
    print("\n".join(shown), flush=True)
    while args.watch and doc["state"] in ("queued", "running"):
        time.sleep(args.interval)
        doc = asyncio.run(oc.job_status(hub, token, args.id))
        lines = _status_lines(doc)
        if lines != shown:
            print("\n" + "\n".join(lines), flush=True)
            shown = lines
    return 0


def cmd_job_download(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    version, body = asyncio.run(oc.download_model(hub, token, args.id, Path(args.output), args.round))
    print(f"wrote {args.output} ({len(body)} bytes, model version {version})")
    return 0


def cmd_job_cancel(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    doc = asyncio.run(oc.cancel_job(hub, token, args.id))
    print(f"{doc['id']}: {doc['state']}")
    return 0


# -- parser --------------------------------------------------------------------------------------


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hub", help=f"hub URL (default ${ENV_HUB})")
    p.add_argument("--token", help=f"bearer token (default ${ENV_TOKEN})")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="URL",
                   help="keep the hub's state in this PostgreSQL database (postgresql://user@host:port/database;"
                        " password from PGPASSWORD or ~/.pgpass); default: SQLite in --data")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuflex-hub", description="GPUFlex hub: serve, tokens, jobs.")
    parser.add_argument("--version", action="version", version=f"gpuflex-hub {_software_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_token(sub)
    _add_migrate(sub)
    _add_job(sub)
    _add_plugins(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the hub")
    p.add_argument("--data", required=True, help="data directory (key, database, blobs)")
    _store_arg(p)
    p.add_argument("--blobs", metavar="s3://BUCKET[/PREFIX]",
                   help="keep blobs (datasets, models, updates) in this S3-compatible bucket under PREFIX/"
                        " (default blobs); credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY;"
                        " default: the folder blobs/ in --data")
    p.add_argument("--s3-endpoint", metavar="URL",
                   help="the bucket's S3-compatible server, http(s)://HOST[:PORT] (default: AWS S3)")
    p.add_argument("--s3-region", metavar="R", help="the bucket's region (default: AWS_DEFAULT_REGION)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N hub processes on one address, sharing the --store postgresql:// database: one leads,"
                        " the others pass requests on to it and take over if it ends (default 1)")
    p.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)  # set by --workers' supervisor
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--long-poll-max", type=float, default=30.0, metavar="S", help="longest work long-poll")
    p.add_argument("--min-deadline", type=float, default=30.0, metavar="S", help="shortest assignment deadline")
    _add_serve_defences(p)
    p.set_defaults(func=cmd_serve)


def _add_serve_defences(p: argparse.ArgumentParser) -> None:
    """serve's admission and Sybil-defence options, their defaults the config's own."""
    from ..base.config import HubConfig  # a small module: the defaults below are the config's own

    d = HubConfig(data_dir=Path("."))
    p.add_argument("--require-enrollment", action="store_true",
                   help="admit only nodes that give an enrollment token (token create --role enroll)")
    p.add_argument("--allow-shared-blocks", action="store_true",
                   help="let replicas of a shard go to nodes of one address block or operator"
                        " (a single-machine test bed only: it lets one operator verify itself)")
    p.add_argument("--ipv4-block-prefix", type=int, default=d.ipv4_block_prefix, metavar="BITS",
                   help="an address block is this IPv4 prefix (default %(default)s)")
    p.add_argument("--ipv6-block-prefix", type=int, default=d.ipv6_block_prefix, metavar="BITS",
                   help="an address block is this IPv6 prefix (default %(default)s)")
    p.add_argument("--registrations-per-block", type=int, default=d.registrations_per_block, metavar="N",
                   help="new node identities per address block (and operator) per hour (default %(default)s)")
    p.add_argument("--registrations-global", type=int, default=d.registrations_global, metavar="N",
                   help="new node identities in all per hour (default %(default)s)")
    p.add_argument("--unproven-max-chunks", type=int, default=d.unproven_max_chunks, metavar="N",
                   help="chunks a node that has delivered nothing may hold; doubles per delivery, 0 = no cap"
                        " (default %(default)s)")
    p.add_argument("--trust-min-age", type=float, default=d.trust_min_age_s, metavar="S",
                   help="a node cannot be trusted before this age in seconds (default %(default)s)")
    p.add_argument("--body-idle-timeout", type=float, default=d.body_idle_timeout_s, metavar="S",
                   help="a request whose body sends no bytes for this long gets 408 and its connection is"
                        " closed; 0 = wait for ever (default %(default)s)")
    p.add_argument("--stage-timeout", type=float, default=d.stage_timeout_s, metavar="S",
                   help="a pipeline stage that reports nothing for this long is lost and its job's"
                        " pipeline re-planned (default %(default)s)")


def _add_token(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tok = sub.add_parser("token", help="manage owner/auditor/admin tokens").add_subparsers(
        dest="token_command", metavar="ACTION", required=True)
    p = tok.add_parser("create", help="create a token and print it (once)")
    p.add_argument("--data", required=True)
    _store_arg(p)
    p.add_argument("--role", required=True, choices=("owner", "auditor", "admin", "enroll"),
                   help="enroll: a token for node operators (gpuflex-node --enroll-token), no API access")
    p.add_argument("--name", required=True)
    p.set_defaults(func=cmd_token_create)
    p = tok.add_parser("list", help="list tokens (never their values)")
    p.add_argument("--data", required=True)
    _store_arg(p)
    p.set_defaults(func=cmd_token_list)
    p = tok.add_parser("revoke", help="revoke a token by id")
    p.add_argument("--data", required=True)
    _store_arg(p)
    p.add_argument("id", help="the id `token list` shows (e<N> for an enrollment token)")
    p.set_defaults(func=cmd_token_revoke)


def _add_migrate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("migrate", help="move a stopped hub's state from SQLite to PostgreSQL")
    p.add_argument("--data", required=True, help="the hub's data directory (hub.sqlite3 in it)")
    p.add_argument("--to", required=True, metavar="URL",
                   help="an empty PostgreSQL database: postgresql://user@host:port/database")
    p.set_defaults(func=cmd_migrate)


def _add_job(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    job = sub.add_parser("job", help="submit and follow training jobs").add_subparsers(
        dest="job_command", metavar="ACTION", required=True)
    p = job.add_parser("submit", help="submit SPEC.toml with a training set (none for node-local data)")
    p.add_argument("spec")
    p.add_argument("--train", help=".npz with x and y, or CSV, or UTF-8 text (.txt) for a transformer; left out "
                                   "for a [data] source = \"node-local\" job, whose data stays on the nodes")
    p.add_argument("--val", help="validation set (optional; like --train)")
    p.add_argument("--base", help="the model to start from: a .safetensors file of the spec's model, such as "
                                  "`job download` writes (optional; a LoRA job freezes it: docs/lora.md)")
    _client_args(p)
    p.set_defaults(func=cmd_job_submit)
    p = job.add_parser("list", help="list your jobs")
    _client_args(p)
    p.set_defaults(func=cmd_job_list)
    p = job.add_parser("status", help="progress and per-round loss/accuracy")
    p.add_argument("id")
    p.add_argument("--watch", action="store_true", help="refresh until the job ends")
    p.add_argument("--interval", type=float, default=1.0)
    _client_args(p)
    p.set_defaults(func=cmd_job_status)
    p = job.add_parser("plan", help="the pipeline plan the job would get on the nodes online now")
    p.add_argument("id")
    _client_args(p)
    p.set_defaults(func=cmd_job_plan)
    p = job.add_parser("download", help="download the model as .safetensors")
    p.add_argument("id")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--round", type=int, help="model after this many rounds (default: latest)")
    _client_args(p)
    p.set_defaults(func=cmd_job_download)
    p = job.add_parser("cancel", help="cancel a job")
    p.add_argument("id")
    _client_args(p)
    p.set_defaults(func=cmd_job_cancel)
    add_rollback(job, _client_args)


def _add_plugins(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The sub-commands of PLUGIN_MODULES that are installed (each module's ``register``)."""
    for name in PLUGIN_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        register = getattr(mod, "register", None)
        if callable(register):
            register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # serve --workers gives them to each worker
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from ..base.errors import HubError

    try:
        return int(func(args) or 0)
    except (OwnerClientError, HubError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file named on the command line: one line, never a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
