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
from urllib.parse import quote

from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.signing import SigningKey, fingerprint

from ..storage.auditlog import LogCheck, verify_log
from . import owner_client as oc

# The owner commands' own helpers: one place resolves --hub/--token and the environment.
from .cli_common import ENV_HUB, ENV_TOKEN, _hub_and_token, format_time, print_columns


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


def _is_time(key: str) -> bool:
    return key.endswith("_at") or key in ("last_seen", "time", "ts")


def _lines(doc: Any, indent: str = "  ", prefix: str = "") -> list[str]:
    """Readable `key: value` lines for nested JSON (times as local ISO with their age)."""
    out: list[str] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                out += _lines(value, indent, f"{name}.")
            elif isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
                for n, item in enumerate(value):
                    out += _lines(item, indent, f"{name}[{n}].")
            elif isinstance(value, list):
                out.append(f"{indent}{name}: {', '.join(_fmt(v) for v in value) or '-'}")
            elif _is_time(str(key)):
                out.append(f"{indent}{name}: {format_time(value)}")
            elif str(key).endswith("_bytes") and isinstance(value, int) and value >= 1 << 20:
                out.append(f"{indent}{name}: {value / (1 << 30):.2f} GiB ({value} bytes)")
            else:
                out.append(f"{indent}{name}: {_fmt(value)}")
    else:
        out.append(f"{indent}{prefix.rstrip('.')}: {_fmt(doc)}")
    return out


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
    rows = [(f["id"], f["status"], f["reason"], f["job_id"], str(f["round"]), f["node_id"])
            for f in reversed(flags)]  # newest first
    print_columns(("flag", "status", "reason", "job", "round", "node"), rows, title=f"{len(flags)} flag(s)")
    if flags:
        print("(`audit show` takes any unique prefix of a flag id)")
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


def _print_flag(flag: dict[str, Any]) -> None:
    """The flag and its evidence as the console's flag page shows them, in plain text."""
    print(f"flag {flag['id']}  {flag['reason']}  {flag['status']}")
    if flag.get("headline"):
        print(f"  failed    {flag['headline']}")
    job = flag["job_id"] + (f" ({flag['job_name']})" if flag.get("job_name") not in (None, flag["job_id"]) else "")
    print(f"  job       {job}, round {flag['round']}")
    upd = flag.get("update") or {}
    facts = ", ".join(f"{k} {_fmt(upd[k])}" for k in ("status", "sample_count", "loss", "train_s", "replica_group")
                      if upd.get(k) is not None)
    print(f"  update    {flag['update_id']}" + (f"  ({facts})" if facts else ""))
    print(f"  node      {flag['node_id']}")
    print(f"  raised    {format_time(flag.get('created_at'))}")
    if flag.get("status") != "open":
        who = f" by {flag['auditor']}" if flag.get("auditor") else ""
        print(f"  decided   {format_time(flag.get('decided_at'))}{who}")
        if flag.get("verdict_note"):
            print(f"  note      {flag['verdict_note']}")
    ev: dict[str, Any] = flag.get("evidence") or {}
    problems = [str(p) for p in ev.get("problems") or []] or ([str(ev["why"])] if ev.get("why") else [])
    if problems:
        print("\nwhy it was flagged")
        for p in problems:
            print(f"  - {p}")
    scores = flag.get("scores") or []
    if scores:
        print("\nscores against thresholds")
        verdicts = {True: "within", False: "BEYOND", None: ""}
        print_columns(("  score", "value", "rule", ""),
                      [(f"  {r['name']}", _fmt(r["value"]), r["rule"], verdicts[r.get("ok")]) for r in scores])
    computed = flag.get("layer_evidence") or {}
    layers = ev.get("layers") if isinstance(ev.get("layers"), list) and ev.get("layers") else computed.get("layers")
    if layers:
        if ev.get("layers"):
            note = "recorded centre: the round's coordinate-wise median, scaled to this shard"
        else:
            note = f"centre: coordinate-wise median of the round's {computed.get('centre_of')} candidate updates"
        print(f"\nper layer against the round's centre ({note})")
        print_columns(("  tensor", "norm", "centre norm", "cosine"),
                      [(f"  {x.get('name')}", _fmt(x.get("norm")), _fmt(x.get("centre_norm")), _fmt(x.get("cosine")))
                       for x in layers])
    elif flag.get("layer_evidence", "absent") is None:
        print("\nper layer: the round or the model is too large to profile here")
    pairs = ev.get("pairs")
    if isinstance(pairs, list) and pairs:
        print(f"\nreplica comparison (tolerance {_fmt(ev.get('tolerance'))}"
              + (f", majority {', '.join(map(str, ev['majority']))}" if ev.get("majority") else "") + ")")
        print_columns(("  update a", "update b", "relative distance", "agree"),
                      [(f"  {p.get('a')}", str(p.get("b")), _fmt(p.get("relative_distance")), _fmt(p.get("agree")))
                       for p in pairs])
    refs = flag.get("referee") or []
    if refs:
        print("\nreferee re-execution (committed states re-executed on the hub: same seed, data order, precision)")
        print_columns(("  update", "node", "round", "steps", "precision", "why checked", "distance", "threshold",
                       "result"),
                      [(f"  {r['update']}" + (" (this)" if r["this"] else ""), r["node"], _fmt(r["round"]),
                        "-".join(map(str, r["steps"])), r["precision"], r["reason"], _fmt(r["distance"]),
                        _fmt(r["threshold"]), r["outcome"] + (f": {r['why']}" if r["why"] else ""))
                       for r in refs])
    shown = {"problems", "why", "layers", "pairs", "tolerance", "majority", "referee", "group"}
    rest = {k: v for k, v in ev.items() if k not in shown}
    if rest:
        print("\nevidence")
        print("\n".join(_lines(rest)))


def _print_node(node: dict[str, Any]) -> None:
    print(f"\nnode {node['id']}")
    state = "BANNED" if node.get("banned") else ("online" if node.get("online") else "offline")
    if node.get("suspended") and not node.get("banned"):
        state = f"SUSPENDED ({node.get('suspension')}), {state}"
    print(f"  state       {state}, software {node.get('software_version', '?')}")
    print(f"  registered  {format_time(node.get('registered_at'))}")
    print(f"  last seen   {format_time(node.get('last_seen'))}")
    print(f"  throughput  benchmark {_fmt(node.get('bench_sps'))} samples/s,"
          f" delivered {_fmt(node.get('ema_sps'))} samples/s (moving average)")
    rep = node.get("reputation") or {}
    print(f"  reputation  {rep.get('consecutive_agreements', 0)} consecutive agreements,"
          f" {rep.get('agreements_total', 0)} in all, {rep.get('flags_total', 0)} disagreements,"
          f" {rep.get('confirmed_flags', 0)} confirmed and {rep.get('dismissed_flags', 0)} dismissed flags")
    print(f"  updates     {node.get('updates_accepted', 0)} accepted,"
          f" {node.get('assignments_failed', 0)} assignments expired or abandoned")
    for key in ("device", "benchmark"):
        if node.get(key):
            print(f"  {key}")
            print("\n".join(_lines(node[key], indent="    ")))


def cmd_show(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    flag = asyncio.run(oc.request_json(hub, token, "GET", f"/v1/flags/{quote(args.flag, safe='')}"))
    node = _node_history(hub, token, flag["node_id"])
    if args.json:
        print(json.dumps({"flag": flag, "node": node}))
        return 0
    _print_flag(flag)
    if node is not None:
        _print_node(node)
    return 0


def cmd_verdict(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    doc = {"verdict": args.verdict, "note": args.note}
    path = f"/v1/flags/{quote(args.flag, safe='')}/verdict"
    out = asyncio.run(oc.request_json(hub, token, "POST", path, data=json.dumps(doc)))
    flag = out["flag"]
    if out.get("banned_by_this_verdict"):
        tail = "; this verdict bans the node"
    elif out.get("node_banned"):
        tail = "; the node was already banned"
    else:
        tail = ""
    print(f"flag {flag['id']}: {flag['status']}{tail}")
    return 0


def _check_pin(public_key: bytes, expected: str | None) -> None:
    if expected and fingerprint(public_key) != expected:
        raise oc.OwnerClientError(
            f"hub key fingerprint is {fingerprint(public_key)}, not the expected {expected}: "
            "this log is not signed by the hub you named"
        )


def _hub_public_key(hub: str) -> bytes:
    """The public key a hub serves at GET /v1/hub (anyone may read it)."""
    info = asyncio.run(oc.request_json(hub.rstrip("/"), "", "GET", "/v1/hub"))
    return bytes.fromhex(str(info["public_key"]))


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
        hub_url = args.hub or os.environ.get(ENV_HUB)
        if args.public_key:
            public_key = bytes.fromhex(args.public_key)
        elif key_path.is_file():
            public_key = SigningKey.load(key_path).public_bytes
        elif hub_url:
            public_key = _hub_public_key(hub_url)
        else:
            raise oc.OwnerClientError(
                f"no hub key beside {log_path}: give --hub URL (the hub's public key is fetched from URL/v1/hub"
                " and checked against --hub-key FINGERPRINT when given), or --public-key HEX (the 'public_key'"
                " field of GET /v1/hub, or ask the hub operator), or verify in the hub's data folder (hub.key)"
            )
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
    p.add_argument("--status", choices=("open", "confirmed", "dismissed", "moot"))
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
    p.add_argument("--hub", help=f"for a copied log: fetch the hub's public key from this URL (or {ENV_HUB});"
                                 " pin it with --hub-key")
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
