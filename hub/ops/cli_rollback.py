"""`gpuflex-hub job rollback`: restore a kept model and continue the job from it
(hub/policy/rollback.py), and the status line that says when one is due."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from . import owner_client as oc
from .cli_common import _hub_and_token


def cmd_job_rollback(args: argparse.Namespace) -> int:
    hub, token = _hub_and_token(args)
    if args.or_oldest_kept and args.before_node is None:
        print("gpuflex-hub job rollback: --or-oldest-kept goes with --before-node", file=sys.stderr)
        return 2
    doc = asyncio.run(oc.rollback_job(hub, token, args.id, before_node=args.before_node, to_round=args.to_round,
                                      oldest_kept=args.or_oldest_kept))
    if args.json:
        print(json.dumps(doc))
        return 0
    undone = ", ".join(str(r) for r in doc["rolled_back"])
    print(f"{doc['job_id']}: restored the model of round {doc['restored_round']} ({doc['model_hash'][:12]});"
          f" rounds {undone} rolled back; round {doc['round']} of {doc['rounds']} opens on it")
    if doc.get("partial"):
        left = ", ".join(str(r) for r in doc["unverified_left"])
        print(f"partial: the oldest kept model; {doc['before_node']}'s unverified rounds {left} stay in the model")
    return 0


def add_rollback(job: argparse._SubParsersAction, client_args: Any) -> None:  # type: ignore[type-arg]
    """The ``job rollback`` parser (``client_args`` adds --hub, --token and --json)."""
    p = job.add_parser("rollback", help="restore a kept model and continue the job from it")
    p.add_argument("id")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--before-node", metavar="NODE",
                       help="the model of the round before NODE's first unverified update")
    which.add_argument("--to-round", metavar="R", type=int, help="the model round R trained from")
    p.add_argument("--or-oldest-kept", action="store_true",
                   help="with --before-node: when that round's model is no longer kept, restore the oldest kept"
                        " one (a partial rollback: the node's unverified rounds before it stay in the model)")
    client_args(p)
    p.set_defaults(func=cmd_job_rollback)


def rollback_notes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """A status line for each suspended or banned node whose unverified updates are in the model."""
    out = []
    for w in doc.get("unverified_work") or ():
        rounds = ", ".join(str(r) for r in w["rounds"])
        how = (f"gpuflex-hub job rollback {doc['id']} --before-node {w['node_id']} restores round"
               f" {w['rollback_to']}'s model" if w["kept"] else f"round {w['rollback_to']}'s model is no longer kept")
        if not w["kept"] and w.get("fallback_to") is not None:
            left = ", ".join(str(r) for r in w["rounds"] if r < w["fallback_to"]) or "none"
            how += (f"; gpuflex-hub job rollback {doc['id']} --before-node {w['node_id']} --or-oldest-kept"
                    f" restores round {w['fallback_to']}'s, leaving rounds {left} in the model")
        out.append(("unverified", f"{w['node_id']} ({w['state']}) had unverified updates aggregated in"
                                  f" rounds {rounds}: {how}"))
    return out
