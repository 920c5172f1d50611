"""Prometheus text metrics: counters kept by the hub, gauges read at scrape time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class HubMetrics:
    rounds_closed: int = 0
    updates_accepted: int = 0
    uploads_resumed: int = 0  # updates whose upload was resumed after an interruption (offset > 0)
    updates_rejected: Counter[str] = field(default_factory=Counter)  # by reason (error code)
    assignments_issued: int = 0
    assignments_expired: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # by route name
    #: the referee (hub/policy/referee.py): state requests opened, verdicts by outcome
    referee_requests: int = 0
    referee_verdicts: Counter[str] = field(default_factory=Counter)
    #: long-polls woken, by why (hub/domain/worksignal.py: all | offer | node | moved)
    poll_wakeups: Counter[str] = field(default_factory=Counter)

    def render(self, gauges: Callable[[], dict[str, float]]) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {value:g}" if isinstance(value, float) else f"{name}{labels} {value}")

        g = gauges()
        metric("gpuflex_nodes_online", "gauge", "Nodes seen within the online window.", [("", g["nodes_online"])])
        metric("gpuflex_nodes_registered", "gauge", "Nodes known to the hub.", [("", g["nodes_registered"])])
        metric("gpuflex_assignments_in_flight", "gauge", "Live assignments.", [("", g["assignments_in_flight"])])
        metric("gpuflex_jobs_active", "gauge", "Jobs queued or running.", [("", g["jobs_active"])])
        metric("gpuflex_rounds_closed_total", "counter", "Rounds aggregated.", [("", self.rounds_closed)])
        metric("gpuflex_assignments_issued_total", "counter", "Assignments handed out.", [("", self.assignments_issued)])
        metric("gpuflex_assignments_expired_total", "counter", "Assignments that passed their deadline.", [("", self.assignments_expired)])
        metric("gpuflex_updates_accepted_total", "counter", "Updates stored.", [("", self.updates_accepted)])
        metric("gpuflex_uploads_resumed_total", "counter", "Updates whose interrupted upload was resumed.",
               [("", self.uploads_resumed)])
        metric(
            "gpuflex_updates_rejected_total", "counter", "Updates refused, by reason.",
            [(f'{{reason="{r}"}}', n) for r, n in sorted(self.updates_rejected.items())] or [('{reason="none"}', 0)],
        )
        metric("gpuflex_bytes_in_total", "counter", "Request body bytes received.", [("", self.bytes_in)])
        metric("gpuflex_bytes_out_total", "counter", "Response body bytes sent.", [("", self.bytes_out)])
        metric(
            "gpuflex_http_requests_total", "counter", "HTTP requests by route.",
            [(f'{{route="{r}"}}', n) for r, n in sorted(self.requests.items())] or [('{route="none"}', 0)],
        )
        metric("gpuflex_referee_requests_total", "counter", "Checkpoint-state requests the referee opened.",
               [("", self.referee_requests)])
        metric(
            "gpuflex_referee_verdicts_total", "counter", "Referee verdicts on re-executed segments, by outcome.",
            [(f'{{outcome="{o}"}}', n) for o, n in sorted(self.referee_verdicts.items())]
            or [('{outcome="none"}', 0)],
        )
        metric(
            "gpuflex_poll_wakeups_total", "counter",
            "Long-polls woken before their wait ran out, by why (all, offer, node, moved).",
            [(f'{{kind="{k}"}}', n) for k, n in sorted(self.poll_wakeups.items())] or [('{kind="none"}', 0)],
        )
        return "\n".join(lines) + "\n"
