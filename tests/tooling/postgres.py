"""A throwaway PostgreSQL server for the tests (tests/conftest.py's `postgres_server`).

`initdb` into a fresh folder, `postgres` on a free 127.0.0.1 port, one database per test, and the
whole cluster removed at the end. PostgreSQL refuses to run as root, so under root (CI, this
project's machines) the server runs as the unprivileged user `nobody` through `setpriv`, in a
folder that user owns. fsync is off: the tests kill hubs, never the machine (the hub's own
sessions still commit with synchronous_commit on).

The binaries are Debian's (`apt-get install -y postgresql`; .ci/run installs it): the newest
/usr/lib/postgresql/*/bin, or the folder named by GPUFLEX_PG_BIN, or initdb on PATH.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MISSING = ("PostgreSQL's initdb is absent (apt-get install -y postgresql), so the tests of the PostgreSQL"
           " store cannot start a server")
USER = "gpuflex"  # the cluster's superuser (initdb -U); it trusts local connections


def find_bin_dir() -> Path | None:
    """The folder with initdb and postgres, or None (GPUFLEX_PG_BIN naming a folder without initdb too)."""
    if os.environ.get("GPUFLEX_PG_BIN"):
        named = Path(os.environ["GPUFLEX_PG_BIN"])
        return named if (named / "initdb").exists() else None

    def version(path: str) -> float:
        try:
            return float(Path(path).parents[1].name)
        except ValueError:
            return 0.0

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PostgresServer:
    bin_dir: Path
    # under root, in /tmp: the server's user must reach it (a root-only $TMPDIR would stop it)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(
        prefix="gpuflex-pg-", dir="/tmp" if os.geteuid() == 0 else None)))
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def _as_server_user(self, argv: list[str], *, die_with_us: bool = False) -> list[str]:
        """Root runs the server as `nobody` (PostgreSQL refuses root); anyone else as themselves.
        `die_with_us`: the server gets SIGINT (fast shutdown) if the test run dies without its teardown."""
        setpriv = ["setpriv", "--pdeathsig", "INT"] if die_with_us and shutil.which("setpriv") else []
        if os.geteuid() != 0:
            return [*setpriv, *argv]
        nobody = pwd.getpwnam("nobody")
        return [*(setpriv or ["setpriv"]), f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                "--clear-groups", *argv]

    def start(self, timeout_s: float = 60.0) -> None:
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
        init = subprocess.run(
            self._as_server_user([str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", USER,
                                  "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]),
            capture_output=True, text=True, check=False)
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed ({init.returncode}):\n{init.stdout}\n{init.stderr}")
        for _ in range(5):  # another process may take the free port first
            self.port = _free_port()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(self._as_server_user([
                    str(self.bin_dir / "postgres"), "-D", str(self.data), "-h", "127.0.0.1",
                    "-p", str(self.port), "-k", str(self.root), "-c", "fsync=off",
                    "-c", "full_page_writes=off", "-c", "max_connections=200"], die_with_us=True),
                    stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready(timeout_s):
                return
            self.stop_server()
        raise RuntimeError(f"postgres did not start; its log:\n{self.log.read_text(errors='replace')[-4000:]}")

    def _wait_ready(self, timeout_s: float) -> bool:
        import psycopg

        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                return True
            except psycopg.OperationalError:
                time.sleep(0.1)
        return False

    def url(self, database: str) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        name = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop_server(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: disconnects clients
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self.stop_server()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)
