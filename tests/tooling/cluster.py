"""The end-to-end tests' cluster: the demo's launcher (gpuflex.hub.ops.localcluster) plus what
only tests need - one benchmark shared by a whole session, the run's store (its hub on PostgreSQL
in `make test`'s second pass, tests/helpers.py), kill -9 of the hub, reading the API over loopback
and the hub's rows, and waiting for a job."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuflex.hub.ops.localcluster import LocalCluster as DemoCluster
from gpuflex.hub.ops.localcluster import Proc, digits_job

from tests.helpers import open_store, store_args, store_for

__all__ = ["LocalCluster", "Proc", "digits_job"]


@dataclass
class LocalCluster(DemoCluster):
    #: where the shared benchmark lives; tests pass one file for the whole session
    shared_bench_cache: Path | None = None

    @property
    def bench_cache(self) -> Path:
        return self.shared_bench_cache or self.workdir / "bench.json"

    @property
    def store(self) -> str | None:
        """The hub's --store: the one the test gave, else this run's (None: its SQLite file)."""
        args = list(self.hub_args)
        if "--store" in args:
            return args[args.index("--store") + 1]
        return store_for(self.hub_dir)

    def start_hub(self, *, timeout_s: float = 60.0) -> Proc:
        """The demo's start, on this run's store unless the test names one (a restart keeps it)."""
        if "--store" not in self.hub_args:
            self.hub_args = (*self.hub_args, *store_args(self.hub_dir))
        return super().start_hub(timeout_s=timeout_s)

    def create_token(self, role: str, name: str) -> str:
        from gpuflex.hub.storage.token_admin import create_token

        return create_token(self.hub_dir, role, name, store=self.store)

    def rows(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        """The rows of a query (``?`` placeholders) on the hub's state, in whichever store it keeps it."""
        conn = open_store(self.hub_dir, self.store)
        try:
            cur = conn.execute(sql, args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        finally:
            conn.close()

    def kill_hub(self, sig: int = signal.SIGKILL, *, timeout_s: float = 15.0) -> int | None:
        if self.hub is None:
            return None
        self.hub.signal(sig)
        try:
            return self.hub.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.hub.signal(signal.SIGKILL)
            return self.hub.popen.wait(timeout=timeout_s)

    def _request(self, path: str, token: str | None) -> urllib.request.Request:
        if not self.url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"refusing to talk to {self.url!r}: the local cluster is loopback only")
        request = urllib.request.Request(self.url + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        return request

    def get_json(self, path: str, token: str | None = None, timeout_s: float = 10.0) -> Any:
        with urllib.request.urlopen(self._request(path, token), timeout=timeout_s) as response:
            return json.loads(response.read())

    def get_bytes(self, path: str, token: str | None = None, timeout_s: float = 30.0) -> bytes:
        with urllib.request.urlopen(self._request(path, token), timeout=timeout_s) as response:
            return bytes(response.read())

    def wait_job(self, job_id: str, token: str, *, timeout_s: float, poll_s: float = 0.25) -> dict[str, Any]:
        """Poll the job until it is done (or failed/cancelled); raise on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status: dict[str, Any] = self.get_json(f"/v1/jobs/{job_id}", token)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                status = {}
            if status.get("state") in {"done", "failed", "cancelled"}:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not finished after {timeout_s:.0f} s: {status.get('state')}")
            time.sleep(poll_s)
