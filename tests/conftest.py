"""Shared fixtures (hub area owns this file; others may append fixtures, carefully)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import (
    RELAXED_SERVE_ARGS,
    TEST_STORE,
    RunningHub,
    start_hub,
    stop_test_store,
    store_args,
    store_for,
    write_digits,
)

torch.set_num_threads(1)

# A test skipped for a missing tool (chromium, ...) ends the run with a banner; CI fails instead.
pytest_plugins = ["tests.tooling.skips"]

#: what a test module must use for the PostgreSQL pass to run it: a hub these helpers start
_STARTS_A_HUB = re.compile(r"\bawait start_hub\(|\brunning_hub\b|\bhub_process\b|\bLocalCluster\(")


@pytest.fixture(scope="session", autouse=True)
def _test_store() -> Iterator[None]:
    """GPUFLEX_TEST_STORE=postgresql: the run's PostgreSQL server (tests/helpers.py), stopped at the end."""
    try:
        yield
    finally:
        stop_test_store()


def pytest_configure(config: pytest.Config) -> None:
    """The PostgreSQL pass without PostgreSQL's binaries: one line, before any test runs."""
    if TEST_STORE == "postgresql":
        from tests.tooling.postgres import MISSING, find_bin_dir

        if find_bin_dir() is None:
            raise pytest.UsageError(f"GPUFLEX_TEST_STORE=postgresql: {MISSING}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The PostgreSQL pass (GPUFLEX_TEST_STORE=postgresql, `make test`'s second run) keeps the tests
    of modules that start a hub (through the helpers, or the end-to-end cluster of
    tests/tooling/cluster.py): the rest (protocol, node, pure units, the SQLite file's own tests)
    never see a store, and ran in the first pass. A test marked ``one_store`` runs in the first
    pass only: a long real-process run whose subject is not the store (an encoding, a model kind,
    a policy at scale), whose store traffic the pass's other tests already make. Reported, not
    silent."""
    if TEST_STORE != "postgresql":
        return
    kept, dropped = [], []
    sources: dict[Path, str] = {}
    for item in items:
        path = Path(item.path)
        if path not in sources:
            sources[path] = path.read_text()
        starts_a_hub = _STARTS_A_HUB.search(sources[path]) is not None
        (kept if starts_a_hub and item.get_closest_marker("one_store") is None else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    config.stash[_PASS_KEY] = (len(kept), len(dropped))


_PASS_KEY = pytest.StashKey[tuple[int, int]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if TEST_STORE == "postgresql" and _PASS_KEY in config.stash:
        kept, dropped = config.stash[_PASS_KEY]
        terminalreporter.write_line(f"PostgreSQL pass: {kept} tests of modules that start a hub ran with their hub on"
                                    f" PostgreSQL; {dropped} (of modules that start none, or marked one_store) ran in the SQLite pass only")


@pytest.fixture
def digits_npz(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(train.npz, val.npz, spec.toml) for the digits MLP job (2 rounds, 1 shard per node per round)."""
    return write_digits(tmp_path / "digits")


@pytest.fixture
async def running_hub(tmp_path: Path) -> AsyncIterator[RunningHub]:
    """The real hub app on 127.0.0.1 (aiohttp AppRunner), data in tmp_path/hub."""
    hub = await start_hub(tmp_path / "hub")
    try:
        yield hub
    finally:
        await hub.stop()


@dataclass
class HubProcess:
    url: str
    data_dir: Path
    admin_token: str
    fingerprint: str
    proc: subprocess.Popen[str]
    output: list[str]

    def token(self, role: str, name: str) -> str:
        from gpuflex.hub.storage.token_admin import create_token

        return create_token(self.data_dir, role, name, store=store_for(self.data_dir))


@pytest.fixture
def hub_process(tmp_path: Path) -> Iterator[HubProcess]:
    """`gpuflex-hub serve` as a real subprocess on a free port; SIGTERM on teardown."""
    data = tmp_path / "hubproc"
    cmd = [
        sys.executable,
        "-m",
        "gpuflex.hub",
        "serve",
        "--data",
        str(data),
        "--port",
        "0",
        "--long-poll-max",
        "2",
        "--min-deadline",
        "5",
        *RELAXED_SERVE_ARGS,  # the test nodes all connect from 127.0.0.1
        *store_args(data),  # GPUFLEX_TEST_STORE=postgresql: its own database (tests/helpers.py)
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    url = fingerprint = admin = ""
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("hub key fingerprint: "):
            fingerprint = line.split(": ", 1)[1].strip()
        elif line.startswith("admin token (shown once): "):
            admin = line.split(": ", 1)[1].strip()
        elif line.startswith("gpuflex-hub listening on "):
            url = line.rsplit(" ", 1)[1].strip()
            break
    if not url:
        proc.kill()
        raise RuntimeError("hub did not start:\n" + "\n".join(lines))
    try:
        yield HubProcess(
            url=url,
            data_dir=data,
            admin_token=admin,
            fingerprint=fingerprint,
            proc=proc,
            output=lines,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- PostgreSQL (the second Store, hub/storage/store_postgres.py) -----------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """A real PostgreSQL server for the whole run (tests/tooling/postgres.py), stopped and
    removed at the end. Without the binaries: a skip that names them, or under CI=true a failure."""
    from tests.tooling.postgres import MISSING, PostgresServer, find_bin_dir
    from tests.tooling.skips import _in_ci

    bin_dir = find_bin_dir()
    if bin_dir is None:
        if _in_ci():
            pytest.fail(f"{MISSING}; CI=true requires it (.ci/run installs it)", pytrace=False)
        pytest.skip(MISSING)
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: Any) -> str:
    """The URL of a fresh, empty database on the session's PostgreSQL server."""
    return str(postgres_server.new_database())
