"""The owner's HTTP client for the hub's JSON API (used by `gpuflex-hub job ...` and the demo).

Every function is async and opens its own short-lived session; errors raise
`OwnerClientError` with the hub's one-line `error: detail`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# aiohttp is imported by the functions that talk to the hub: `gpuflex-hub --version` and
# `--help` import this module (for OwnerClientError) and should start at once.


class OwnerClientError(Exception):
    """The hub refused a request (or could not be reached); `status` 0 = no HTTP answer."""

    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


async def request(hub: str, token: str, method: str, path: str, *, data: Any = None,
                  timeout_s: float = 600.0) -> tuple[bytes, dict[str, str]]:
    import aiohttp

    url = hub.rstrip("/") + path
    headers = {"Authorization": f"Bearer {token}"} if token else {}  # "": an anonymous route
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session, \
                session.request(method, url, data=data, headers=headers) as resp:
            body = await resp.read()
            if resp.status >= 400:
                try:
                    doc = json.loads(body)
                    code, detail = str(doc.get("error")), str(doc.get("detail"))
                except ValueError:
                    code, detail = "http_error", body[:200].decode(errors="replace")
                raise OwnerClientError(f"{resp.status} {code}: {detail}", resp.status, code)
            return body, dict(resp.headers)
    except aiohttp.ClientError as exc:
        raise OwnerClientError(f"cannot reach the hub at {hub}: {exc}") from None


async def request_json(hub: str, token: str, method: str, path: str, *, data: Any = None) -> Any:
    body, _ = await request(hub, token, method, path, data=data)
    return json.loads(body)


async def submit_job(hub: str, token: str, spec: Path, train: Path | None, val: Path | None = None,
                     *, base: Path | None = None) -> dict[str, Any]:
    """POST /v1/jobs; returns {"id", "job_id", "name", "state", "rounds", "chunks", "model_hash"}.
    ``base``: the model to start from (.safetensors)."""
    import aiohttp

    form = aiohttp.FormData()
    spec_bytes = Path(spec).read_bytes()  # noqa: ASYNC240 - a small local file
    form.add_field("spec", spec_bytes, filename=Path(spec).name, content_type="application/toml")
    handles = []
    try:
        for name, path in (("train", train), ("val", val), ("base", base)):
            if path is None:
                continue
            fh = open(path, "rb")  # noqa: ASYNC230 - streamed by aiohttp, closed below
            handles.append(fh)
            form.add_field(name, fh, filename=Path(path).name, content_type="application/octet-stream")
        doc = await request_json(hub, token, "POST", "/v1/jobs", data=form)
    finally:
        for fh in handles:
            fh.close()
    doc["job_id"] = doc["id"]
    return doc


async def list_jobs(hub: str, token: str) -> list[dict[str, Any]]:
    return list((await request_json(hub, token, "GET", "/v1/jobs"))["jobs"])


async def job_status(hub: str, token: str, job_id: str) -> dict[str, Any]:
    """Exactly the GET /v1/jobs/{id} document."""
    return dict(await request_json(hub, token, "GET", f"/v1/jobs/{job_id}"))


async def job_plan(hub: str, token: str, job_id: str) -> dict[str, Any]:
    """Exactly the GET /v1/jobs/{id}/plan document: a plan, or {"refused": one line, ...}."""
    return dict(await request_json(hub, token, "GET", f"/v1/jobs/{job_id}/plan"))


async def download_model(hub: str, token: str, job_id: str, output: Path | None = None,
                         round_: int | None = None) -> tuple[int, bytes]:
    """(model version, .safetensors bytes); also written atomically to `output` when given."""
    path = f"/v1/jobs/{job_id}/model" + (f"?round={round_}" if round_ is not None else "")
    body, headers = await request(hub, token, "GET", path)
    if output is not None:
        out = Path(output)
        tmp = out.with_name(out.name + ".part")
        tmp.write_bytes(body)
        os.replace(tmp, out)
    return int(headers.get("X-GPUFlex-Model-Version", "-1")), body


async def cancel_job(hub: str, token: str, job_id: str) -> dict[str, Any]:
    return dict(await request_json(hub, token, "POST", f"/v1/jobs/{job_id}/cancel"))


async def rollback_job(hub: str, token: str, job_id: str, *, before_node: str | None = None,
                       to_round: int | None = None, oldest_kept: bool = False) -> dict[str, Any]:
    """POST /v1/jobs/{id}/rollback: what was restored and undone."""
    body: dict[str, Any] = {k: v for k, v in (("before_node", before_node), ("to_round", to_round)) if v is not None}
    if oldest_kept:
        body["oldest_kept"] = True
    return dict(await request_json(hub, token, "POST", f"/v1/jobs/{job_id}/rollback", data=json.dumps(body)))
