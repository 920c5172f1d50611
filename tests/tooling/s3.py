"""A throwaway S3-compatible server for the tests: moto's `moto_server` (pip install 'moto[server]')
as a separate process on a free 127.0.0.1 port, answering real HTTP like any S3 endpoint.

`S3Server.start()` waits until it answers; `stop()` ends it (the process dies with the test run
as well: `setpriv --pdeathsig`). Credentials are the fixed test pair below, set in the
environment the way a hub operator would (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "gpuflex-test", "AWS_SECRET_ACCESS_KEY": "gpuflex-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
#: no profile, config file or instance role of the machine running the tests gets in the way
ISOLATION = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
             "AWS_EC2_METADATA_DISABLED": "true"}
MISSING = "moto's S3 server is absent (pip install 'moto[server]>=5'), so the S3 blob store tests cannot run"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="gpuflex-moto-", suffix=".log")[1]))
    started_in_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        t0 = time.monotonic()
        die_with_us = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
        for _ in range(5):  # another process may take the free port first
            self.port = free_port()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [*die_with_us, sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ISOLATION})
            if self._wait_ready(timeout_s):
                self.started_in_s = time.monotonic() - t0
                return
            self.stop()
        raise RuntimeError(f"moto_server did not start; its log:\n{self.log.read_text(errors='replace')[-4000:]}")

    def _wait_ready(self, timeout_s: float) -> bool:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2):
                    return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def client(self) -> Any:
        """A plain boto3 client on the server (the test's own hands on the bucket)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session(aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                     aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"]).client(
            "s3", endpoint_url=self.url, region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))

    def new_bucket(self) -> str:
        name = f"gpuflex-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def cleanup(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            self.log.unlink()
