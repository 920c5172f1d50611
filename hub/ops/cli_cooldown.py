"""`gpuflex-hub cooldown ...`: the operator's view of a ban's address-block cooldowns.

A banned node's /24 (IPv6 /48) and operator cool down: no new identity registers from them for
the hub's ``--ban-cooldown`` (hub/policy/admission.py). A NAT can hide innocent contributors
behind the banned node's block, so `list` shows every block and operator cooling down, with the
time left and the ban that caused it, and `lift ADDRESS` lifts a block's cooldown for one IP
address (or for the whole block, named as listed). Both talk to a running hub with an admin
token; a lift is recorded in the hub's audit log (``cooldown_lift``) and kept across restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from . import owner_client as oc
from .cli_common import ENV_HUB, ENV_TOKEN, _hub_and_token, format_time, print_columns


def remaining(seconds: float) -> str:
    """A duration as the operator reads it: '6.9 d', '5.2 h', '12 min', '40 s'."""
    for unit, size in (("d", 86400.0), ("h", 3600.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def cooldown_rows(cooldowns: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row a cooldown: kind, name, time left, until, the ban that caused it, what was lifted."""
    return [
        (
            c["kind"],
            c["name"],
            remaining(float(c["remaining_s"])),
            format_time(c["until"]),
            f"ban of {c['node_id'] or '?'} at {format_time(c['banned_at'])}",
            ", ".join(c["lifted"]) or "-",
        )
        for c in cooldowns
    ]


def cmd_list(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    cooldowns = asyncio.run(oc.request_json(hub, token, "GET", "/v1/cooldowns"))["cooldowns"]
    if args.json:
        print(json.dumps({"cooldowns": cooldowns}))
        return 0
    print_columns(
        ("kind", "name", "left", "until", "cause", "lifted for"),
        cooldown_rows(cooldowns),
        title=f"{len(cooldowns)} cooling down",
    )
    if any(c["kind"] == "block" for c in cooldowns):
        print(
            "(`cooldown lift ADDRESS` admits new identities from one address of a block again, or from"
            " all of it when ADDRESS is the block)"
        )
    return 0


def cmd_lift(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    out = asyncio.run(
        oc.request_json(
            hub,
            token,
            "POST",
            "/v1/cooldowns/lift",
            data=json.dumps({"address": args.address, "note": args.note}),
        )
    )
    what = (
        "the whole block"
        if out["address"] == out["block"]
        else f"{out['address']} in {out['block']}"
    )
    print(
        f"lifted the cooldown of {what} (ban of {out['banned_node']}, which ran until"
        f" {format_time(out['until'])}); recorded in the audit log"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cool = subparsers.add_parser(
        "cooldown", help="address blocks cooling down after a ban: list, lift"
    )
    sub = cool.add_subparsers(dest="cooldown_command", metavar="ACTION", required=True)

    def client(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hub", help=f"hub URL (or {ENV_HUB})")
        p.add_argument("--token", help=f"admin token (or {ENV_TOKEN})")

    p = sub.add_parser(
        "list", help="blocks and operators cooling down, the time left and the ban that caused it"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    client(p)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser(
        "lift", help="admit new identities from one address of a cooled-down block again"
    )
    p.add_argument(
        "address", help="an IP address, or a block as `cooldown list` names it (all of it)"
    )
    p.add_argument("--note", default="", help="why (kept in the audit log)")
    client(p)
    p.set_defaults(func=cmd_lift)
