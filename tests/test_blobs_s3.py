"""The BlobStore contract on both stores: the local folder, and an S3-compatible bucket served by a
real `moto_server` process on 127.0.0.1 (tests/tooling/s3.py). Then the S3 store's own promises
(a tampered object is refused, a bounded cache, one-line errors) and a real hub running a job
to `done` with its blobs in the bucket."""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from gpuflex.hub.base.config import HubConfig
from gpuflex.hub.base.errors import BadRequest, NotFound
from gpuflex.hub.storage.backend import open_blob_store
from gpuflex.hub.storage.blobs import HOT_BLOB_MAX, BlobStore, BlobStoreUnavailable

from tests.helpers import (
    RELAXED_SERVE_ARGS,
    SimNode,
    open_store,
    start_hub,
    submit_job,
    wait_job,
    write_digits,
)
from tests.tooling.s3 import CREDENTIALS, ISOLATION, MISSING, S3Server

boto3 = pytest.importorskip("boto3", reason=MISSING)
pytest.importorskip("moto.server", reason=MISSING)

from gpuflex.hub.storage import blobs_s3  # noqa: E402 - needs boto3, checked above
from gpuflex.hub.storage.blobs_s3 import S3BlobStore  # noqa: E402


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The credentials as an operator gives them: in the environment."""
    for name, value in {**CREDENTIALS, **ISOLATION}.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


StoreFactory = Callable[..., BlobStore]


@pytest.fixture(params=["local", "s3"])
def new_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Each call: a store as a freshly started hub opens it. Local: the same folder again (a
    restart). S3: the same bucket with a fresh, empty local folder (a replaced hub), or with
    ``same_folder=True`` the first store's folder again (a restart)."""
    if request.param == "local":
        return lambda same_folder=False: BlobStore(tmp_path / "blobs")
    server: S3Server = request.getfixturevalue("s3_server")
    name = server.new_bucket()
    count = iter(range(1000))

    def make(same_folder: bool = False) -> BlobStore:
        root = tmp_path / ("blobs-0" if same_folder else f"blobs-{next(count)}")
        return S3BlobStore(root, bucket=name, prefix="hub-a/blobs", endpoint=server.url,
                           multipart_over=6 << 20, part_bytes=5 << 20)

    return make


def _blob(size: int, seed: int = 0) -> bytes:
    return (hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1))[:size]


# -- the contract, on both stores --------------------------------------------------------------


def test_put_read_has_read_private_and_path(new_store: StoreFactory) -> None:
    store = new_store()
    small, large = _blob(1000, 1), _blob(HOT_BLOB_MAX + 4096, 2)
    for data in (small, large):
        sha = store.put(data)
        assert sha == hashlib.sha256(data).hexdigest()
        assert store.put(data) == sha  # idempotent
        assert store.has(sha) and store.read(sha) == data
        assert bytes(store.read_private(sha)) == data
        assert store.path(sha).read_bytes() == data
    absent = "0" * 64
    assert not store.has(absent) and not store.path(absent).is_file()
    with pytest.raises(NotFound):
        store.read(absent)
    with pytest.raises(NotFound):
        store.read_private(absent)
    with pytest.raises(BadRequest):
        store.has("../../etc/passwd")
    # a fresh store (nothing in memory; for S3 nothing on disk): a large blob comes back as a
    # private copy-on-write map, a write to which changes nothing stored
    again = new_store()
    sha = hashlib.sha256(large).hexdigest()
    view = again.read_private(sha)
    assert isinstance(view, mmap.mmap) and view[:] == large
    view[0] ^= 0xFF
    assert again.read(sha) == large and again.path(sha).read_bytes() == large
    view.close()


def test_streamed_upload_through_temp_path_and_commit_temp(new_store: StoreFactory) -> None:
    store = new_store()
    for data in (_blob(3000, 3), _blob(11 << 20, 4)):  # the large one goes to S3 in parts
        tmp = store.temp_path()
        assert tmp.parent == store.tmp
        with open(tmp, "wb") as fh:
            for i in range(0, len(data), 1 << 20):
                fh.write(data[i:i + (1 << 20)])
            fh.flush()
            os.fsync(fh.fileno())
        sha = hashlib.sha256(data).hexdigest()
        final = store.commit_temp(tmp, sha)
        assert not tmp.exists() and final.read_bytes() == data and store.has(sha)
        assert new_store().read(sha) == data  # what a restarted or replaced hub reads
    assert not any(store.tmp.iterdir())


def test_partial_uploads_are_held_listed_and_committed(new_store: StoreFactory) -> None:
    store = new_store()
    data = _blob(200_000, 5)
    sha = hashlib.sha256(data).hexdigest()
    part = store.partial_path("a-123", sha)
    part.write_bytes(data[:70_000])  # the link dropped here
    assert store.partial_uploads() == [("a-123", part)]
    assert not store.has(sha)
    restarted = new_store(same_folder=True)  # partial/ is in the local folder: a restart keeps it
    assert restarted.partial_uploads() == [("a-123", part)]
    with open(part, "ab") as fh:  # the node resumes and sends the rest
        fh.write(data[70_000:])
    restarted.commit_temp(part, sha)
    assert not part.exists() and restarted.partial_uploads() == []
    assert new_store().read(sha) == data
    with pytest.raises(NotFound):
        store.partial_path("../x", sha)
    with pytest.raises(BadRequest):
        store.partial_path("a-1", "not-a-sha")


def test_a_fresh_store_sees_every_committed_blob(new_store: StoreFactory) -> None:
    first = new_store()
    blobs = [_blob(n, n) for n in (1, 500, HOT_BLOB_MAX + 1, 7 << 20)]
    shas = [first.put(b) for b in blobs]
    tmp = first.temp_path()
    tmp.write_bytes(b"streamed")
    shas.append(first.commit_temp(tmp, hashlib.sha256(b"streamed").hexdigest()).name)
    blobs.append(b"streamed")
    fresh = new_store()
    for sha, data in zip(shas, blobs, strict=True):
        assert fresh.has(sha) and fresh.read(sha) == data and fresh.path(sha).read_bytes() == data


def test_discarded_blobs_are_gone_and_the_others_stay(new_store: StoreFactory) -> None:
    """`discard` (blobs nothing refers to any more: old rounds' models) drops packed, hot and
    file blobs alike, here and for a fresh store; a blob not stored is skipped."""
    store = new_store()
    gone = [store.put(_blob(n, n)) for n in (300, HOT_BLOB_MAX + 1)]
    kept = store.put(_blob(400, 9))
    store.read(gone[0])  # in memory too
    store.discard([*gone, "0" * 64])
    for probe in (store, new_store()):
        assert not any(probe.has(sha) for sha in gone) and probe.read(kept) == _blob(400, 9)
        with pytest.raises(NotFound):
            probe.read(gone[0])


# -- the bucket's own promises ---------------------------------------------------------------------


def _s3(tmp_path: Path, server: S3Server, bucket: str, name: str = "blobs", **kw: object) -> S3BlobStore:
    return S3BlobStore(tmp_path / name, bucket=bucket, endpoint=server.url, **kw)  # type: ignore[arg-type]


def test_put_returns_once_the_bucket_holds_the_object(tmp_path: Path, s3_server: S3Server, bucket: str) -> None:
    """Durability: when put (and so a hub's 2xx) returns, the object is in the bucket, whole,
    under <prefix>/<sha>; the hub process and its folder can go at once."""
    store = _s3(tmp_path, s3_server, bucket, prefix="p/q")
    data = _blob(40_000, 6)
    sha = store.put(data)
    got = s3_server.client().get_object(Bucket=bucket, Key=f"p/q/{sha}")["Body"].read()
    assert got == data


def test_the_bucket_store_packs_nothing(tmp_path: Path, s3_server: S3Server, bucket: str) -> None:
    """Small blobs are packed into the local folder's pack.sqlite3 (hub/storage/blobpack.py) only without a
    bucket: with one, every blob, the empty one too, is an object there, which outlives the folder."""
    store = _s3(tmp_path, s3_server, bucket)
    for data in (b"", b"x", _blob(900, 7)):
        sha = store.put(data)
        got = s3_server.client().get_object(Bucket=bucket, Key=f"blobs/{sha}")["Body"].read()
        assert got == data
    assert not (tmp_path / "blobs" / "pack.sqlite3").exists()


def test_a_tampered_object_is_refused_when_read_into_the_cache(tmp_path: Path, s3_server: S3Server,
                                                               bucket: str) -> None:
    store = _s3(tmp_path, s3_server, bucket)
    data = _blob(HOT_BLOB_MAX + 10, 7)
    sha = store.put(data)
    s3_server.client().put_object(Bucket=bucket, Key=f"blobs/{sha}", Body=data[:-1] + b"X")
    fresh = _s3(tmp_path, s3_server, bucket, name="fresh")
    for read in (fresh.read, fresh.read_private, fresh.path):
        with pytest.raises(BlobStoreUnavailable) as err:
            read(sha)
        assert err.value.code == "blob_corrupt" and sha in err.value.detail and bucket in err.value.detail
    assert not fresh._cache_path(sha).exists() and not any(fresh.tmp.iterdir())  # nothing kept
    assert store.read(sha) == data  # the hub that wrote it still has its checked copy


def test_the_read_cache_stays_within_its_bound(tmp_path: Path, s3_server: S3Server, bucket: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobs_s3, "CACHE_GRACE_S", 0.0)
    store = _s3(tmp_path, s3_server, bucket, cache_bytes=3 * (HOT_BLOB_MAX + 1))
    blobs = [_blob(HOT_BLOB_MAX + 1, 10 + i) for i in range(6)]
    shas = [store.put(b) for b in blobs]
    assert store.cached_bytes() <= 3 * (HOT_BLOB_MAX + 1)
    cached = sum(1 for p in store.cache.rglob("*") if p.is_file())
    assert cached == 3
    for sha, data in zip(shas, blobs, strict=True):  # dropped ones come back from the bucket
        assert store.path(sha).read_bytes() == data
    assert store.cached_bytes() <= 3 * (HOT_BLOB_MAX + 1)
    # a restart finds what the cache held and keeps to the bound
    again = _s3(tmp_path, s3_server, bucket, cache_bytes=HOT_BLOB_MAX + 1)
    assert sum(1 for p in again.cache.rglob("*") if p.is_file()) == 1


def test_a_missing_bucket_is_one_line_at_start_up(tmp_path: Path, s3_server: S3Server) -> None:
    with pytest.raises(BlobStoreUnavailable) as err:
        _s3(tmp_path, s3_server, "no-such-bucket")
    msg = str(err.value)
    assert "\n" not in msg and "no-such-bucket" in msg and s3_server.url in msg
    assert "does not exist" in msg


def test_a_wrong_endpoint_is_one_line_naming_it(tmp_path: Path, s3_server: S3Server) -> None:
    from tests.tooling.s3 import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(BlobStoreUnavailable) as err:
        S3BlobStore(tmp_path / "blobs", bucket="gpuflex-x", endpoint=endpoint, max_attempts=1)
    msg = str(err.value)
    assert "\n" not in msg and endpoint in msg and "gpuflex-x" in msg and "cannot connect" in msg


def test_bad_credentials_are_one_line_and_never_shown(tmp_path: Path, s3_server: S3Server, bucket: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(BlobStoreUnavailable) as err:
        _s3(tmp_path, s3_server, bucket)
    assert "no credentials" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("blobs", "endpoint", "region", "says"), [
    ("/srv/blobs", None, None, "--blobs takes s3://BUCKET[/PREFIX]"),
    ("s3://Bad_Bucket", None, None, "is not a bucket name"),
    ("s3://good-bucket/a//b", None, None, "is not a key prefix"),
    ("s3://good-bucket", "ftp://host", None, "--s3-endpoint takes http(s)://HOST[:PORT]"),
    (None, "http://127.0.0.1:9000", None, "need --blobs"),
])
def test_bad_options_are_one_line(tmp_path: Path, blobs: str | None, endpoint: str | None,
                                  region: str | None, says: str) -> None:
    config = HubConfig(data_dir=tmp_path, blobs=blobs, s3_endpoint=endpoint, s3_region=region)
    from gpuflex.hub.storage.blobs import check_s3_options

    with pytest.raises(BlobStoreUnavailable) as err:
        check_s3_options(config.blobs, config.s3_endpoint, config.s3_region)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_config_picks_the_store(tmp_path: Path, s3_server: S3Server, bucket: str) -> None:
    assert type(open_blob_store(HubConfig(data_dir=tmp_path / "a"))) is BlobStore
    store = open_blob_store(HubConfig(data_dir=tmp_path / "b", blobs=f"s3://{bucket}/x/y",
                                      s3_endpoint=s3_server.url, s3_region="eu-west-1"))
    assert isinstance(store, S3BlobStore) and store.prefix == "x/y" and store.root == tmp_path / "b" / "blobs"


def test_serve_with_a_missing_bucket_says_so_in_one_line(tmp_path: Path, s3_server: S3Server,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from gpuflex.hub.ops.cli import main

    rc = main(["serve", "--data", str(tmp_path / "hub"), "--port", "0", "--blobs", "s3://not-there/hub",
               "--s3-endpoint", s3_server.url])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err and "not-there" in err and s3_server.url in err, err
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in err
    rc = main(["serve", "--data", str(tmp_path / "hub2"), "--blobs", "bucket"])
    assert rc == 1 and "--blobs takes s3://" in capsys.readouterr().err
    assert not (tmp_path / "hub2").exists()  # refused before anything was created


# -- a real hub on the bucket ------------------------------------------------------------------------


async def test_a_hub_on_the_bucket_runs_a_job_to_done(tmp_path: Path, s3_server: S3Server, bucket: str) -> None:
    train, val, spec = write_digits(tmp_path / "d", rounds=2)
    hub = await start_hub(tmp_path / "hub", blobs=f"s3://{bucket}/gpuflex", s3_endpoint=s3_server.url)
    try:
        async with aiohttp.ClientSession() as s:
            r = await submit_job(s, hub, spec, train, val)
            assert r.status == 201, await r.text()
            job = await r.json()
            node = SimNode(s, hub.url)
            await node.register()
            for _ in range(2):
                await node.step()
            doc = await wait_job(s, hub, job["id"])
            assert [h["round"] for h in doc["history"]] == [0, 1]
            async with s.get(f"{hub.url}/v1/jobs/{job['id']}/model", headers=hub.auth()) as r:
                assert r.status == 200
    finally:
        await hub.stop()

    conn = open_store(tmp_path / "hub")
    try:
        models = [sha for (sha,) in conn.execute("SELECT sha FROM models WHERE job_id = ?", (job["id"],))]
        chunks = [sha for (sha,) in conn.execute("SELECT sha FROM chunks WHERE job_id = ?", (job["id"],))]
        updates = [sha for (sha,) in conn.execute("SELECT sha FROM updates WHERE job_id = ?", (job["id"],))]
    finally:
        conn.close()
    assert len(models) == 3 and chunks and updates  # the initial model and one after each round
    client = s3_server.client()
    listed = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="gpuflex/")["Contents"]}
    assert {f"gpuflex/{sha}" for sha in models + chunks + updates} <= listed
    for sha in models:  # each model, whole, in the bucket
        body = client.get_object(Bucket=bucket, Key=f"gpuflex/{sha}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == sha


def _serve(data: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """`gpuflex-hub serve` as a real process, credentials in its environment; (process, URL)."""
    proc = subprocess.Popen([sys.executable, "-m", "gpuflex.hub", "serve", "--data", str(data), "--port", "0",
                             *RELAXED_SERVE_ARGS, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("gpuflex-hub listening on "):
            return proc, line.rsplit(" ", 1)[1].strip()
    proc.kill()
    raise AssertionError("hub did not start:\n" + "".join(seen))


async def test_a_2xx_outlives_kill_9_and_the_loss_of_the_local_folder(tmp_path: Path, s3_server: S3Server,
                                                                      bucket: str) -> None:
    """A submitted job's 201 came after its blobs were in the bucket: kill -9 the hub, delete its
    blob folder (working area and cache), start it again: the job's model is still served."""
    from gpuflex.hub.storage.token_admin import create_token

    train, val, spec = write_digits(tmp_path / "d", rounds=2)
    data = tmp_path / "hub"
    flags = ("--blobs", f"s3://{bucket}/hub", "--s3-endpoint", s3_server.url)
    proc, url = _serve(data, *flags)
    try:
        token = create_token(data, "owner", "alice")
        form = aiohttp.FormData()
        form.add_field("spec", spec.read_bytes(), filename="spec.toml")
        form.add_field("train", train.read_bytes(), filename="train.npz")
        form.add_field("val", val.read_bytes(), filename="val.npz")
        async with aiohttp.ClientSession() as s, \
                s.post(f"{url}/v1/jobs", data=form, headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 201, await r.text()
            job = await r.json()
        proc.kill()  # SIGKILL the moment the 2xx is in
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    shutil.rmtree(data / "blobs")
    proc, url = _serve(data, *flags)
    try:
        async with aiohttp.ClientSession() as s, \
                s.get(f"{url}/v1/jobs/{job['id']}/model", headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-GPUFlex-Model-Hash"] == job["model_hash"]
            assert (data / "blobs" / "cache" / job["model_hash"][:2] / job["model_hash"]).is_file()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
