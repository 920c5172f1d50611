"""`gpuflex-hub audit ...`: the auditor's commands.

`list`, `show` and `verdict` talk to a running hub with an auditor token (an owner token
may read the flags on its own jobs). `verify-log` checks the hash chain and the hub's
signatures of the audit log offline, from a data folder or from a hub URL, and names the
first line that does not verify.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.signing import SigningKey, fingerprint

from . import owner_client as oc
from .auditlog import LogCheck, verify_log

# The owner commands' own helpers: one place resolves --hub/--token and the environment.
from .cli import ENV_HUB, ENV_TOKEN, _hub_and_token


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def cmd_list(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    query = []
    if args.status:
        query.append(f"status={args.status}")
    if args.job:
        query.append(f"job={args.job}")
    path = "/v1/flags" + ("?" + "&".join(query) if query else "")
    flags = asyncio.run(oc.request_json(hub, token, "GET", path))["flags"]
    if args.json:
        print(json.dumps({"flags": flags}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("flag", "status", "reason", "job", "round", "node", title=f"{len(flags)} flag(s)")
    for f in reversed(flags):  # newest first
        table.add_row(f["id"], f["status"], f["reason"], f["job_id"], str(f["round"]), f["node_id"])
    Console().print(table)
    return 0


def _node_history(hub: str, token: str, node_id: str) -> dict[str, Any] | None:
    try:
        nodes = asyncio.run(oc.request_json(hub, token, "GET", "/v1/nodes"))["nodes"]
    except oc.OwnerClientError:
        return None  # an owner may not list nodes; the flag itself is still shown
    for node in nodes:
        if node.get("id") == node_id or node.get("node_id") == node_id:
            return dict(node)
    return None


def cmd_show(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    flag = asyncio.run(oc.request_json(hub, token, "GET", f"/v1/flags/{args.flag}"))
    node = _node_history(hub, token, flag["node_id"])
    if args.json:
        print(json.dumps({"flag": flag, "node": node}))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"[bold]flag {flag['id']}[/bold]  {flag['reason']}  status {flag['status']}")
    for key in ("job_id", "round", "update_id", "node_id", "created_at", "auditor", "verdict_note"):
        if flag.get(key) not in (None, ""):
            console.print(f"  {key:<12} {_fmt(flag[key])}")
    evidence = flag.get("evidence") or {}
    scalars = {k: v for k, v in evidence.items() if not isinstance(v, (dict, list))}
    if scalars:
        table = Table("evidence", "value", title="scores against thresholds")
        for key, value in sorted(scalars.items()):
            table.add_row(key, _fmt(value))
        console.print(table)
    layers = evidence.get("layers")
    if isinstance(layers, list) and layers:
        table = Table("tensor", "norm", "centre norm", "cosine", title="per layer against the round's centre")
        for layer in layers:
            table.add_row(
                str(layer.get("name")), _fmt(layer.get("norm")),
                _fmt(layer.get("centre_norm")), _fmt(layer.get("cosine")),
            )  # fmt: skip
        console.print(table)
    pairs = evidence.get("pairs")
    if isinstance(pairs, list) and pairs:
        table = Table("update a", "update b", "relative distance", "agree", title="replica comparison")
        for pair in pairs:
            table.add_row(
                str(pair.get("a")), str(pair.get("b")),
                _fmt(pair.get("relative_distance")), str(pair.get("agree")),
            )  # fmt: skip
        console.print(table)
    other = {k: v for k, v in evidence.items() if isinstance(v, (dict, list)) and k not in ("layers", "pairs")}
    for key, value in other.items():
        console.print(f"  {key}: {json.dumps(value)[:600]}")
    if node is not None:
        console.print("[bold]node history[/bold]")
        for key, value in node.items():
            if not isinstance(value, (dict, list)):
                console.print(f"  {key:<24} {_fmt(value)}")
            else:
                console.print(f"  {key:<24} {json.dumps(value)[:300]}")
    return 0


def cmd_verdict(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    doc = {"verdict": args.verdict, "note": args.note}
    out = asyncio.run(oc.request_json(hub, token, "POST", f"/v1/flags/{args.flag}/verdict", data=json.dumps(doc)))
    flag = out["flag"]
    print(f"flag {flag['id']}: {flag['status']}" + ("; the node is now banned" if out.get("node_banned") else ""))
    return 0


def _check_pin(public_key: bytes, expected: str | None) -> None:
    if expected and fingerprint(public_key) != expected:
        raise oc.OwnerClientError(
            f"hub key fingerprint is {fingerprint(public_key)}, not the expected {expected}: "
            "this log is not signed by the hub you named"
        )


def cmd_verify_log(args: argparse.Namespace) -> int:
    source = args.source or os.environ.get(ENV_HUB)
    if not source:
        raise oc.OwnerClientError(f"say where the log is: --from DIR or --from URL (or set {ENV_HUB})")
    if source.startswith(("http://", "https://")):
        hub = source.rstrip("/")
        token = args.token or os.environ.get(ENV_TOKEN)
        if not token:
            raise oc.OwnerClientError(f"reading the log from a hub needs an auditor token: --token or {ENV_TOKEN}")
        info = asyncio.run(oc.request_json(hub, token, "GET", "/v1/hub"))
        public_key = bytes.fromhex(info["public_key"])
        _check_pin(public_key, args.hub_key)
        body, _ = asyncio.run(oc.request(hub, token, "GET", "/v1/audit-log"))
        lines: list[bytes] = body.splitlines(keepends=True)
        where = f"{hub}/v1/audit-log"
    else:
        folder = Path(source)
        log_path = folder / "audit.jsonl" if folder.is_dir() else folder
        key_path = (folder if folder.is_dir() else folder.parent) / "hub.key"
        if args.public_key:
            public_key = bytes.fromhex(args.public_key)
        elif key_path.is_file():
            public_key = SigningKey.load(key_path).public_bytes
        else:
            raise oc.OwnerClientError(f"no hub key beside {log_path}: pass --public-key HEX")
        _check_pin(public_key, args.hub_key)
        if not log_path.is_file():
            raise oc.OwnerClientError(f"no audit log at {log_path}")
        lines = log_path.read_bytes().splitlines(keepends=True)
        where = str(log_path)
    check: LogCheck = verify_log(lines, public_key, expected_head=args.expected_head)
    if check.ok:
        print(f"audit log OK: {check.entries} entries, chain and signatures verified ({where}); head {check.head}")
        return 0
    kind = "incomplete" if check.truncated else "TAMPERED"
    print(f"audit log {kind}: {check.problem} ({check.entries} entries verified before it; {where})")
    return 1


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    audit = subparsers.add_parser("audit", help="review flags, give verdicts, verify the audit log")
    sub = audit.add_subparsers(dest="audit_command", metavar="ACTION", required=True)

    def client(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hub", help=f"hub URL (or {ENV_HUB})")
        p.add_argument("--token", help=f"auditor token (or {ENV_TOKEN})")

    p = sub.add_parser("list", help="list flags, newest first")
    p.add_argument("--status", choices=("open", "confirmed", "dismissed"))
    p.add_argument("--job", help="only this job's flags")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    client(p)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="a flag with its evidence and the node's history")
    p.add_argument("flag")
    p.add_argument("--json", action="store_true")
    client(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("verdict", help="confirm or dismiss a flag")
    p.add_argument("flag")
    p.add_argument("verdict", choices=("confirm", "dismiss"))
    p.add_argument("--note", required=True, help="why (kept in the audit log)")
    client(p)
    p.set_defaults(func=cmd_verdict)

    p = sub.add_parser("verify-log", help="check the audit log's chain and signatures offline")
    p.add_argument("--from", dest="source", help="a hub data folder, an audit.jsonl file, or a hub URL")
    p.add_argument("--hub-key", help="expected hub key fingerprint (gf1-...)")
    p.add_argument("--public-key", help="the hub public key in hex, when no hub.key is at hand")
    p.add_argument("--expected-head", help="a head hash seen earlier: detects entries cut off the end")
    p.add_argument("--token", help=f"auditor token when reading from a URL (or {ENV_TOKEN})")
    p.set_defaults(func=_guarded(cmd_verify_log))


def _guarded(func: Any) -> Any:
    """Turn key-file and decoding errors into one line and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (ProtocolError, ValueError, OSError) as exc:
            print(f"gpuflex-hub audit: {exc}", file=sys.stderr)
            return 2

    return run
