"""Committed blobs in an S3-compatible bucket, through boto3 (`gpuflex-hub serve --blobs s3://...`).

Each blob is the object ``<prefix>/<sha256>`` in the bucket. The hub's local folder stays its
working area: ``tmp/`` (uploads being received, downloads being checked), ``partial/`` (what
interrupted uploads left, for the node to resume) and ``cache/``, a bounded read cache of blob
files, so ``path`` still gives a file and ``read_private`` still maps one.

Durable: ``put`` and ``commit_temp`` return only once the bucket has answered the PUT (S3 answers
200 only for a stored object), sent with the bytes' Content-MD5 (the server refuses bytes that do
not match it) and checked in return: the ETag is that MD5, or else a HEAD shows the object's
size. A hub 2xx built on them outlives the hub process and its folder.

Trusting no one: a blob read from the bucket into the cache is hashed on the way and refused
unless it hashes to its id. A file is moved into the cache only complete and fsynced.

Credentials come from boto3's usual places (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a
profile, an instance role); they are never taken on the command line, and no message here holds one.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
)

from .blobs import BlobStore, BlobStoreUnavailable, check_blob_id, is_blob_id

#: a blob up to this size is sent in one PUT; a larger one in parts (S3 takes at most 5 GiB at once)
MULTIPART_OVER = 1 << 30
PART_BYTES = 64 << 20
#: a cached file used this recently is never dropped (a caller may be about to open it)
CACHE_GRACE_S = 120.0
DOWNLOAD_PIECE = 1 << 20

_WHAT = {
    "NoSuchBucket": "the bucket does not exist",
    "AccessDenied": "access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy)",
    "403": "access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy)",
    "InvalidAccessKeyId": "the access key is not known to the server (AWS_ACCESS_KEY_ID)",
    "SignatureDoesNotMatch": "the secret key does not match the access key (AWS_SECRET_ACCESS_KEY)",
    "BadDigest": "the bytes the bucket received do not match their Content-MD5",
}


def _client_config(endpoint: str | None, max_attempts: int) -> Config:
    kw: dict[str, Any] = {
        "connect_timeout": 10, "read_timeout": 120, "max_pool_connections": 32,
        "retries": {"max_attempts": max_attempts, "mode": "standard"},
    }
    if endpoint is not None:  # an S3-compatible server: bucket in the path, not in a host name
        kw["s3"] = {"addressing_style": "path"}
    try:  # botocore >= 1.36 adds CRC trailers many S3-compatible servers refuse: only when required
        return Config(**kw, request_checksum_calculation="when_required",
                      response_checksum_validation="when_required")
    except TypeError:
        return Config(**kw)


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""


class S3BlobStore(BlobStore):
    """A `BlobStore` whose committed blobs live in ``bucket`` under ``prefix/``; ``root`` (the
    hub's blobs/ folder) holds tmp/, partial/ and a read cache of at most ``cache_bytes``."""

    #: every blob, however small, is an object in the bucket: the bucket is what outlives this machine
    packed_max = 0

    def __init__(self, root: Path, *, bucket: str, prefix: str = "blobs", endpoint: str | None = None,
                 region: str | None = None, cache_bytes: int = 8 << 30, max_attempts: int = 4,
                 multipart_over: int = MULTIPART_OVER, part_bytes: int = PART_BYTES) -> None:
        super().__init__(root)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.cache_bytes, self.multipart_over, self.part_bytes = cache_bytes, multipart_over, part_bytes
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region, config=_client_config(endpoint, max_attempts))
        self.endpoint = endpoint or str(self.client.meta.endpoint_url)
        self.cache = root / "cache"
        self.cache.mkdir(exist_ok=True)
        self._lru: OrderedDict[str, tuple[int, float]] = OrderedDict()  # sha -> (size, last use)
        self._lru_bytes = 0
        self._lru_lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._scan_cache()
        try:  # a missing bucket, a wrong endpoint, bad keys: a start-up error, not a later 500
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise self._failure("open the bucket", exc, bucket_call=True) from None

    def __repr__(self) -> str:
        return f"S3BlobStore({self.where})"

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint}"

    def key(self, sha: str) -> str:
        return f"{self.prefix}/{check_blob_id(sha)}"

    # -- the contract -----------------------------------------------------------------------------

    def path(self, sha: str) -> Path:
        """A local file with the blob's bytes, read from the bucket (and checked) when not cached;
        a path where no file is when the bucket has no such blob."""
        local = self._cache_path(sha)
        if local.is_file():
            self._used(sha)
            return local
        return self._fetch(sha)

    def has(self, sha: str) -> bool:
        return self._cache_path(sha).is_file() or self._size_in_bucket(sha) is not None

    def commit_temp(self, tmp: Path, sha: str) -> Path:
        """Store the temp file's bytes in the bucket under ``sha`` (its caller checked the hash),
        then keep the file in the cache. Returns once the bucket has acknowledged them."""
        final = self._cache_path(sha)
        if final.is_file():  # in the cache: it came from the bucket or went there
            tmp.unlink(missing_ok=True)
            return final
        size = tmp.stat().st_size
        self._upload(tmp, sha, size)  # the same bytes again when the bucket has them: harmless
        final.parent.mkdir(exist_ok=True)
        os.replace(tmp, final)  # the bucket holds the blob: losing this rename costs a download
        self._add(sha, size)
        return final

    # -- the bucket -------------------------------------------------------------------------------

    def _failure(self, action: str, exc: BaseException, *, bucket_call: bool = False) -> BlobStoreUnavailable:
        """One line naming the endpoint and the bucket, what was being done and what went wrong."""
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            if bucket_call and code in ("404", "NotFound"):
                code = "NoSuchBucket"
            what = _WHAT.get(code) or f"{code or 'error'}: {_first_line(str(err.get('Message', '')))}".rstrip(": ")
        elif isinstance(exc, EndpointConnectionError):
            what = "cannot connect to the endpoint"
        elif isinstance(exc, NoCredentialsError):
            what = "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        else:
            what = _first_line(str(exc)) or type(exc).__name__
        return BlobStoreUnavailable(f"blob store {self.where}: cannot {action}: {what}")

    def _size_in_bucket(self, sha: str) -> int | None:
        """The object's size, or None when the bucket has no such blob (HEAD)."""
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(sha))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._failure(f"look up blob {sha}", exc) from None
        except BotoCoreError as exc:
            raise self._failure(f"look up blob {sha}", exc) from None
        return int(head["ContentLength"])

    def _upload(self, src: Path, sha: str, size: int) -> None:
        key = self.key(sha)
        try:
            if size <= self.multipart_over:
                md5 = hashlib.md5(usedforsecurity=False)
                with open(src, "rb") as fh:
                    while piece := fh.read(DOWNLOAD_PIECE):
                        md5.update(piece)
                    fh.seek(0)
                    resp = self.client.put_object(
                        Bucket=self.bucket, Key=key, Body=fh, ContentLength=size,
                        ContentMD5=base64.b64encode(md5.digest()).decode(), ContentType="application/octet-stream")
                if str(resp.get("ETag", "")).strip('"') == md5.hexdigest():
                    return  # the bucket stored exactly these bytes
            else:
                self._upload_parts(src, key)
        except (BotoCoreError, ClientError) as exc:
            raise self._failure(f"store blob {sha}", exc) from None
        # an ETag that is no MD5 (parts, some encryption): the object must be there, whole
        got = self._size_in_bucket(sha)
        if got != size:
            raise BlobStoreUnavailable(f"blob store {self.where}: blob {sha} was sent ({size} bytes) but the"
                                       f" bucket holds {'nothing' if got is None else f'{got} bytes'} under it")

    def _upload_parts(self, src: Path, key: str) -> None:
        upload_id = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, ContentType="application/octet-stream")["UploadId"]
        try:
            parts = []
            with open(src, "rb") as fh:
                for number in itertools.count(1):
                    piece = fh.read(self.part_bytes)
                    if not piece:
                        break
                    md5 = base64.b64encode(hashlib.md5(piece, usedforsecurity=False).digest()).decode()
                    r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                PartNumber=number, Body=piece, ContentMD5=md5)
                    parts.append({"ETag": r["ETag"], "PartNumber": number})
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(BotoCoreError, ClientError):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def _fetch(self, sha: str) -> Path:
        """Read the blob from the bucket into the cache, checking its hash (one download per blob
        at a time); the cache path, where no file is when the bucket has no such blob."""
        final = self._cache_path(sha)
        with self._lru_lock:
            lock = self._fetching.setdefault(sha, threading.Lock())
        try:
            with lock:
                if final.is_file():  # another thread fetched it meanwhile
                    self._used(sha)
                    return final
                tmp = self.temp_path()
                try:
                    size = self._download(sha, tmp)
                    if size is None:
                        return final
                    final.parent.mkdir(exist_ok=True)
                    os.replace(tmp, final)
                finally:
                    tmp.unlink(missing_ok=True)
                self._add(sha, size)
                return final
        finally:
            with self._lru_lock:
                self._fetching.pop(sha, None)

    def _download(self, sha: str, tmp: Path) -> int | None:
        """The object's bytes into ``tmp``, fsynced and checked against ``sha``; their size, or
        None when there is no such object."""
        digest = hashlib.sha256()
        size = 0
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self.key(sha))
            with open(tmp, "wb") as fh:
                for piece in resp["Body"].iter_chunks(DOWNLOAD_PIECE):
                    digest.update(piece)
                    fh.write(piece)
                    size += len(piece)
                fh.flush()
                os.fsync(fh.fileno())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._failure(f"read blob {sha}", exc) from None
        except BotoCoreError as exc:
            raise self._failure(f"read blob {sha}", exc) from None
        if digest.hexdigest() != sha:
            raise BlobStoreUnavailable(f"blob store {self.where}: blob {sha} read from the bucket hashes to"
                                       f" {digest.hexdigest()[:16]}..., not to its id: refused (the bucket's"
                                       " copy was damaged or replaced)", code="blob_corrupt")
        return size

    # -- the read cache ---------------------------------------------------------------------------

    def _cache_path(self, sha: str) -> Path:
        check_blob_id(sha)
        return self.cache / sha[:2] / sha

    def _scan_cache(self) -> None:
        """What an earlier run left in the cache (complete files only: each was renamed in
        whole), oldest first."""
        found = []
        for sub in self.cache.iterdir():
            for p in sub.iterdir() if sub.is_dir() else ():
                if is_blob_id(p.name):
                    st = p.stat()
                    found.append((st.st_mtime, p.name, st.st_size))
        for _, sha, size in sorted(found):
            self._lru[sha] = (size, 0.0)
            self._lru_bytes += size
        self._evict()

    def _used(self, sha: str) -> None:
        with self._lru_lock:
            entry = self._lru.get(sha)
            if entry is not None:
                self._lru[sha] = (entry[0], time.monotonic())
                self._lru.move_to_end(sha)

    def _add(self, sha: str, size: int) -> None:
        with self._lru_lock:
            if sha not in self._lru:
                self._lru_bytes += size
            self._lru[sha] = (size, time.monotonic())
            self._lru.move_to_end(sha)
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used files while the cache is over its size, never one used
        within CACHE_GRACE_S (a caller may still open it; an open file or a map outlives it)."""
        now = time.monotonic()
        drop = []
        with self._lru_lock:
            while self._lru_bytes > self.cache_bytes and self._lru:
                sha, (size, used) = next(iter(self._lru.items()))
                if used and now - used < CACHE_GRACE_S:
                    break
                del self._lru[sha]
                self._lru_bytes -= size
                drop.append(sha)
        for sha in drop:
            self._cache_path(sha).unlink(missing_ok=True)

    def discard(self, shas: list[str]) -> None:
        """Drop the blobs from the bucket and the cache (see BlobStore.discard)."""
        super().discard(shas)
        for sha in shas:
            with self._lru_lock:
                size, _ = self._lru.pop(sha, (0, 0.0))
                self._lru_bytes -= size
            self._cache_path(sha).unlink(missing_ok=True)
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.key(sha))
            except (BotoCoreError, ClientError) as exc:
                raise self._failure("delete a blob", exc) from None

    def cached_bytes(self) -> int:
        with self._lru_lock:
            return self._lru_bytes
