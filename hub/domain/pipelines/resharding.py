"""What a re-plan moves: the unit state that changes node (the least any re-plan can move), and
the unit state the new generation's nodes actually download from the hub.

A node keeps the unit states it uploaded in its blob cache, so a node that keeps its units
downloads none of them; the two figures are equal when every node holds what it can.
Both are in memory, for the live generation, and ``job status`` shows them.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...model.pipeline import Generation, PipelineState, UnitRecord


def state_bytes_moved(
    previous: Generation | None, g: Generation, committed: Mapping[int, UnitRecord]
) -> int:
    """The bytes of committed unit states whose node differs between ``previous`` and ``g``."""
    if previous is None:
        return 0
    return sum(
        committed[u].size
        for slot in g.stages
        for u in range(slot.unit_start, slot.unit_end)
        if u in committed and previous.holder(u) != slot.node_id
    )


def count_served(jobs: Mapping[str, PipelineState], node_id: str, sha: str, size: int) -> None:
    """``size`` bytes of blob ``sha`` went to ``node_id``: counted when it is a unit state the
    node's StageAssignment names."""
    for state in jobs.values():
        if state.generation is not None and sha in state.named.get(node_id, ()):
            state.state_bytes_served += size
            return


__all__ = ["count_served", "state_bytes_moved"]
