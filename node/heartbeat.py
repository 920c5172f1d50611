"""The heartbeat: while an assignment is in hand, the node tells the hub it is alive (a slow
device is not a dead one), takes the deadline the hub extends, and stops training when the hub
no longer wants the work (expired, job cancelled)."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from .assignment_run import Current
from .client import HubClient
from .output import Output
from .pause import PauseState

log = logging.getLogger(__name__)

__all__ = ["heartbeat_loop"]


class BeatHost(Protocol):
    """What the heartbeat reads of the node (node/agent.NodeAgent)."""

    current: Current | None
    output: Output
    pause_state: PauseState

    @property
    def stop_training(self) -> threading.Event: ...
    def _client(self) -> HubClient: ...


async def heartbeat_loop(agent: BeatHost, every_s: float) -> None:
    pause = agent.pause_state
    while not pause.exited.is_set():
        await pause.tick(every_s)
        cur = agent.current
        if cur is None or cur.phase not in ("downloading", "training", "uploading") or pause.exiting:
            continue
        try:
            ack = await agent._client().heartbeat(cur.assignment.assignment_id, cur.progress, cur.steps,
                                                  cur.digest)
        except Exception as exc:  # NodeError or a bug: the next beat tries again
            log.info("heartbeat failed: %s", exc)
            continue
        if ack.deadline > 0:
            cur.deadline = ack.deadline
        if not ack.ok and cur.phase != "uploading":
            cur.stop_reason = f"hub dropped it: {ack.detail}"[:256]
            agent.output.event("error", detail=cur.stop_reason)
            agent.stop_training.set()
        agent.output.event("heartbeat", assignment_id=cur.assignment.assignment_id, progress=round(cur.progress, 3))
