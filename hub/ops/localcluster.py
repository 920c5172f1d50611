"""The demo's launcher: a hub and its nodes as real processes on this machine.

Every process is started in its own session and remembered by PID, so `close()` can stop
all of them (SIGTERM, then SIGKILL after a grace period) even when the caller is
interrupted. Nothing here talks to a node in-process: the hub never imports the node.
Only what `gpuflex-hub demo` needs lives here; the end-to-end tests extend it with their
own tools (kill the hub, poll a job, read the API) in tests/tooling/cluster.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuflex.protocol.signing import SigningKey

#: The repository root when running from a source checkout (editable install or `make demo`).
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def attack_tooling_available() -> bool:
    """Misbehaving contributors live in the test tooling, which only a source checkout has."""
    return (SOURCE_ROOT / "tests" / "tooling" / "attacks.py").is_file()


@dataclass(frozen=True)
class JobFiles:
    spec: Path
    train: Path
    val: Path


def digits_job(
    directory: Path,
    *,
    name: str = "digits-mlp",
    rounds: int = 15,
    local_epochs: int = 3,
    chunk_size: int = 64,
    replication: str | float = "adaptive",
    round_target_s: float = 2.0,
    seed: int = 0,
    extra_toml: str = "",
) -> JobFiles:
    """Write the bundled job: an MLP 64-128-10 on scikit-learn's digits (shipped, no download).

    The split is stratified 80/20 with random_state=0 and features divided by 16, the same
    preparation as the Flower comparison in bench/vs_flower.py.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    directory.mkdir(parents=True, exist_ok=True)
    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        x / 16.0, y, test_size=0.2, stratify=y, random_state=0
    )
    train = directory / "train.npz"
    val = directory / "val.npz"
    np.savez(train, x=x_train.astype(np.float32), y=y_train.astype(np.int64))
    np.savez(val, x=x_val.astype(np.float32), y=y_val.astype(np.int64))
    replication_toml = (
        f'"{replication}"' if isinstance(replication, str) else repr(float(replication))
    )
    spec = directory / "spec.toml"
    spec.write_text(
        f"""[job]
name = "{name}"

[model]
kind = "mlp"
input = 64
hidden = [128]
outputs = 10
activation = "relu"

[train]
rounds = {rounds}
local_epochs = {local_epochs}
batch_size = 32
optimizer = "sgd"
lr = 0.05
momentum = 0.9
seed = {seed}
round_target_s = {round_target_s}

[data]
chunk_size = {chunk_size}
split = "stratified"

[verification]
replication = {replication_toml}
{extra_toml}
"""
    )
    return JobFiles(spec=spec, train=train, val=val)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # One BLAS/OpenMP thread per process: the nodes share the machine with the hub.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    pythonpath = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{SOURCE_ROOT}{os.pathsep}{pythonpath}" if pythonpath else str(SOURCE_ROOT)
    return env


@dataclass
class Proc:
    """One started process, its log file and (for nodes) its identity."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    node_id: str = ""
    data_dir: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def events(self) -> list[dict[str, Any]]:
        """The structured JSON lines a node writes when its output is not a terminal."""
        out: list[dict[str, Any]] = []
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    out.append(event)
        return out

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)


@dataclass
class LocalCluster:
    """A hub process plus node processes under one working directory."""

    workdir: Path
    hub_args: Sequence[str] = ()
    procs: list[Proc] = field(default_factory=list)
    hub: Proc | None = None
    url: str = ""
    fingerprint: str = ""
    port: int = 0
    #: each node connects from its own 127.0.N.1 (Linux routes all of 127.0.0.0/8 to loopback), so
    #: the nodes sit in distinct address blocks and the hub's Sybil defences run as in production
    distinct_blocks: bool = True
    #: where the hub listens: "0.0.0.0" lets nodes in other network namespaces reach it (the
    #: bandwidth bench's shaped home lines); the owner's side still talks to 127.0.0.1
    hub_host: str = "127.0.0.1"
    _addresses: dict[str, str] = field(default_factory=dict)

    @property
    def hub_dir(self) -> Path:
        return self.workdir / "hub"

    @property
    def bench_cache(self) -> Path:
        """One benchmark for every node of this machine (`gpuflex-node bench --bench-cache`)."""
        return self.workdir / "bench.json"

    def benchmark_once(self, *, threads: int = 1, timeout_s: float = 180.0) -> None:
        """Measure this machine once, so that N node processes do not benchmark N times."""
        if self.bench_cache.exists():
            return
        argv = [
            sys.executable, "-m", "gpuflex.node", "bench", "--device", "cpu",
            "--threads", str(threads), "--bench-cache", str(self.bench_cache), "--json",
        ]  # fmt: skip
        subprocess.run(
            argv, env=_child_env(), cwd=str(SOURCE_ROOT), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s, check=False,
        )  # fmt: skip

    # ---------------------------------------------------------------- processes
    def _spawn(self, name: str, argv: Sequence[str]) -> Proc:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as sink:
            popen = subprocess.Popen(
                list(argv),
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_child_env(),
                cwd=str(SOURCE_ROOT),
                start_new_session=True,  # Ctrl+C reaches us, and we stop the children by PID
            )
        proc = Proc(name=name, popen=popen, log=log)
        self.procs.append(proc)
        return proc

    def start_hub(self, *, timeout_s: float = 60.0) -> Proc:
        """Start `gpuflex-hub serve`; the first start picks a free port, restarts reuse it."""
        self.hub_dir.mkdir(parents=True, exist_ok=True)
        url_file = self.hub_dir / "hub.url"
        if url_file.exists():
            url_file.unlink()
        argv = [
            sys.executable, "-m", "gpuflex.hub", "serve",
            "--data", str(self.hub_dir), "--host", self.hub_host, "--port", str(self.port),
            *self.hub_args,
        ]  # fmt: skip
        self.hub = self._spawn("hub", argv)
        deadline = time.monotonic() + timeout_s
        while not url_file.exists():
            if not self.hub.alive():
                raise RuntimeError(f"the hub exited during start-up; see {self.hub.log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the hub did not start within {timeout_s:.0f} s; see {self.hub.log}")
            time.sleep(0.05)
        self.url = url_file.read_text().strip()
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])
        if self.hub_host == "0.0.0.0":
            self.url = f"http://127.0.0.1:{self.port}"
        self.fingerprint = SigningKey.load(self.hub_dir / "hub.key").fingerprint
        return self.hub

    def source_address(self, name: str) -> str | None:
        """The loopback address node `name` connects from (the same on a restart): 127.0.N.1."""
        if not self.distinct_blocks or sys.platform != "linux":
            return None
        if name not in self._addresses:
            n = len(self._addresses) + 1
            self._addresses[name] = f"127.{n // 250}.{n % 250 + 1}.1"
        return self._addresses[name]

    def start_node(self, name: str, *, attack: str | None = None, extra: Sequence[str] = (),
                   hub_url: str | None = None, prefix: Sequence[str] = ()) -> Proc:
        """Start a node process (one thread); its identity is created here first so we know its id.
        ``prefix`` runs it through a wrapper (``ip netns exec NS``: a node on its own network),
        reaching the hub at ``hub_url``."""
        data_dir = self.workdir / "nodes" / name
        data_dir.mkdir(parents=True, exist_ok=True)
        key = SigningKey.load_or_create(data_dir / "node.key")
        self.benchmark_once()
        run_args = [
            "run", "--hub", hub_url or self.url, "--hub-key", self.fingerprint, "--data-dir", str(data_dir),
            "--device", "cpu", "--threads", "1", "--bench-cache", str(self.bench_cache), *extra,
        ]  # fmt: skip
        if not prefix and (source := self.source_address(name)) is not None:
            run_args += ["--source-address", source]
        if attack is None:
            argv = [sys.executable, "-m", "gpuflex.node", *run_args]
        else:
            if not attack_tooling_available():
                raise RuntimeError("misbehaving nodes need the test tooling of a source checkout")
            argv = [sys.executable, "-m", "tests.tooling.attacks", "--attack", attack, *run_args]
        proc = self._spawn(name, [*prefix, *argv])
        proc.node_id = key.fingerprint
        proc.data_dir = data_dir
        return proc

    def wait_registered(self, procs: Sequence[Proc] | None = None, *, timeout_s: float = 120.0) -> None:
        """Block until each node has logged its `registered` event (it benchmarks first)."""
        pending = list(procs if procs is not None else self.nodes())
        deadline = time.monotonic() + timeout_s
        while pending:
            for proc in list(pending):
                if any(e.get("event") == "registered" for e in proc.events()):
                    pending.remove(proc)
                elif not proc.alive():
                    raise RuntimeError(f"{proc.name} exited before registering; see {proc.log}")
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise TimeoutError(f"not registered after {timeout_s:.0f} s: {names}")
            time.sleep(0.05)

    def create_token(self, role: str, name: str) -> str:
        from gpuflex.hub.storage.token_admin import create_token

        return create_token(self.hub_dir, role, name)

    def close(self, *, grace_s: float = 10.0) -> None:
        """Stop every process we started: SIGTERM, wait, then SIGKILL. Safe to call twice."""
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                proc.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                proc.signal(signal.SIGKILL)
                proc.popen.wait()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def nodes(self) -> Iterator[Proc]:
        return (p for p in self.procs if p.name != "hub")
