import time

import aiohttp
from gpuflex.hub.tokens import create_token

from tests.test_console_helpers import (
    first_flag_of,
    job_doc,
    run_job_with_attacker,
    start_console_hub,
)


async def test_scenario(tmp_path, monkeypatch):
    t0 = time.monotonic()
    hub = await start_console_hub(tmp_path / "hub", monkeypatch)
    try:
        bob = create_token(hub.data_dir, "owner", "bob")
        sc = await run_job_with_attacker(hub, tmp_path / "d", other_owner_token=bob)
        print("scenario", time.monotonic() - t0)
        async with aiohttp.ClientSession() as s:
            doc = await job_doc(s, hub, sc.job_id)
        for h in doc["history"]:
            print(h["round"], h["loss"], h["accuracy"], h["replication_overhead"], [(u["node_id"][-4:], u["status"], u["chunks"]) for u in h["updates"]], h["flags"])
        print(await first_flag_of(hub, sc.attacker))
    finally:
        await hub.stop()
