"""`gpuflex-hub` starts without torch: parsing arguments, `--version` and `--help` must not
pay for `import torch` (1.5-3 s). Torch loads where a model or tensor is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = "import sys; {body}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"


def _loaded(body: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE.format(body=body)], capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_protocol_specs_and_the_hub_cli_import_without_torch():
    assert _loaded("import gpuflex.protocol.jobspec, gpuflex.protocol.messages, gpuflex.protocol.signing") == "[]"
    assert _loaded("import gpuflex.hub.ops.cli; gpuflex.hub.ops.cli.build_parser()") == "[]"


def test_torch_loads_where_it_is_used():
    assert _loaded("from gpuflex.protocol import encode_state, TensorSpec") == "['numpy', 'torch']"
    spec = '[job]\\nname = \\"x\\"\\n[model]\\nkind = \\"mlp\\"\\ninput = 4\\nhidden = []\\noutputs = 2\\n'
    # parsing a spec checks the model's shapes on the meta device: torch is needed there
    assert "torch" in _loaded(f"from gpuflex.protocol.jobspec import parse_job_spec; parse_job_spec(\"{spec}\")")


@pytest.mark.parametrize("argv", [["--version"], ["job", "--help"], ["audit", "--help"]])
def test_gpuflex_hub_commands_run_without_torch(argv):
    """The installed script itself; -X importtime lists every module it imports."""
    script = Path(sys.executable).parent / "gpuflex-hub"
    out = subprocess.run([sys.executable, "-X", "importtime", str(script), *argv], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, COLUMNS="100"))
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert "torch" not in imported and "numpy" not in imported, sorted(m for m in imported if "torch" in m)[:5]


async def test_a_malformed_hub_key_is_refused_in_one_line_before_the_benchmark(running_hub, tmp_path):
    """`gpuflex-node run --hub-key not-a-key` is a typo, not an impersonation: one line naming the
    format, exit 2, at once: no benchmark, no key made, the hub never asked."""
    import asyncio
    import time

    data = tmp_path / "node"
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuflex.node", "run", "--hub", running_hub.url, "--hub-key", "not-a-key",
        "--data-dir", str(data), "--device", "cpu", "--threads", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    took = time.monotonic() - started
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, err.decode()[-2000:])
    assert len(lines) == 1 and "--hub-key" in lines[0] and "gf1-abcd-efgh-ijkl-mnop-qrst" in lines[0], lines
    assert "not-a-key" in lines[0] and "impersonat" not in err.decode().lower()
    assert not (data / "bench.json").exists() and not (data / "node.key").exists()
    assert took < 4.0, took  # the benchmark alone takes about 4 s
    for argv in (["data", "add", "j-x", str(tmp_path / "x.npz")], ["data", "remove", "j-x"]):
        done = subprocess.run([sys.executable, "-m", "gpuflex.node", *argv, "--hub", running_hub.url,
                               "--hub-key", "gf1-abcd", "--data-dir", str(data)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "gf1-abcd-efgh-ijkl-mnop-qrst" in done.stderr, done.stderr


def test_a_cached_bench_answers_without_loading_torch(tmp_path):
    """`gpuflex-node bench` with this hardware's result cached reads the cache without importing
    torch (1-3 s of the 4 s a cached answer took): the first run measures, the second prints the
    same figures, marked cached, and -X importtime lists no torch module."""
    import time

    data = tmp_path / "node"
    argv = [sys.executable, "-m", "gpuflex.node", "bench", "--device", "cpu", "--threads", "1", "--json",
            "--data-dir", str(data)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    measured = json.loads(first.stdout)
    assert measured["cached"] is False
    started = time.monotonic()
    again = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert again.returncode == 0, again.stderr[-2000:]
    cached = json.loads(again.stdout)
    assert cached["cached"] is True and cached["fingerprint"] == measured["fingerprint"]
    assert cached["precision_sps"] == measured["precision_sps"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in again.stderr.splitlines() if line.startswith("import time")}
    assert "torch" not in imported, sorted(m for m in imported if "torch" in m)[:5]
    print(f"cached bench answered in {took:.2f} s")


def test_the_torch_free_bench_key_is_the_hardware_fingerprint():
    """node/hostinfo.py's fingerprint (no torch) is device.py's for a CPU, whatever the thread
    count and oneDNN setting: a cache written by one is found by the other."""
    import torch
    from gpuflex.node.device import hardware_fingerprint, onednn_enabled, set_onednn
    from gpuflex.node.hostinfo import cpu_fingerprint

    threads, onednn = torch.get_num_threads(), onednn_enabled()
    try:
        for n in (1, 2, 3):
            for on in (True, False):
                torch.set_num_threads(n)
                set_onednn(on)
                assert cpu_fingerprint(threads=n, onednn=on) == hardware_fingerprint(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
        set_onednn(onednn)


def test_a_hub_on_sqlite_serves_without_the_postgres_and_s3_extras(tmp_path):
    """`pip install gpuflex` (no extras) must run `gpuflex-hub serve`: psycopg and boto3 are
    made unimportable in the child, and the hub still starts, writes its url and answers."""
    import time
    import urllib.request

    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('psycopg', 'boto3', 'botocore'):\n"
               "            raise ModuleNotFoundError(f'No module named {name!r} (blocked by the test)')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import runpy; sys.argv = ['gpuflex-hub'] + sys.argv[1:]\n"
               "runpy.run_module('gpuflex.hub', run_name='__main__')\n")
    data = tmp_path / "hub"
    proc = subprocess.Popen([sys.executable, "-c", blocker, "serve", "--data", str(data), "--host", "127.0.0.1",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (data / "hub.url").exists():
            assert proc.poll() is None, proc.stdout.read()[-2000:] if proc.stdout else proc.returncode
            assert time.monotonic() < deadline, "no hub.url within 60 s"
            time.sleep(0.1)
        url = (data / "hub.url").read_text().strip()
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(30)
