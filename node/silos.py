"""Node-local data ("silos"): a dataset that stays on this node and trains a node-local job.

``gpuflex-node data add JOB PATH`` reads the operator's ``.npz`` or CSV, checks it against the
job's schema with the protocol's own rules (``protocol/dataset.py``, the hub's for uploads),
encodes it as a chunk blob and keeps it here; the hub learns only the blob id (SHA-256 of the
blob), its size, the sample count and, when the operator opts in and the job asks, the label
histogram. The hub's assignments for the job then name that blob as their one chunk, and the
node reads it from this store, never from the network.

Layout under ``<data dir>/silos/`` (0700; every file 0600, written atomically)::

    <sha256>.gft   an encoded silo (the chunk format: encode_state of x and y)
    index.json     {"version": 1,
                    "silos":      {job_id: {sha256, size, samples, source, added_at,
                                            histogram_shared}},
                    "superseded": {sha256: job_id},  replaced by a later add; the blob stays
                                                     until prune(), so an assignment signed for
                                                     it can still train
                    "retired":    {sha256: job_id}}  removed or pruned: an assignment naming one
                                                     is refused, never downloaded
    .lock          serialises changes to the index (``data add`` while the node runs)

One silo per job. Reading a blob back checks its size and SHA-256: a tampered or truncated
file is a SiloError, never trained on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

from gpuflex.protocol.dataset import (
    Arrays,
    DatasetError,
    check_dataset_file,
    read_arrays,
    validate_arrays,
)
from gpuflex.protocol.errors import ProtocolError
from gpuflex.protocol.messages import BLOB_ID_RE, SiloSchema

from .errors import NodeError
from .files import write_private_file

if TYPE_CHECKING:
    import numpy as np

INDEX_FILE: Final = "index.json"
LOCK_FILE: Final = ".lock"
BLOB_SUFFIX: Final = ".gft"
INDEX_VERSION: Final = 1
#: a blob or temp file no record names, older than this, is a leftover of an interrupted `data add`
STRAY_AFTER_S: Final = 3600.0
MAX_RETIRED: Final = 1000
SUBSET_SEED: Final = 0
#: the largest chunk an assignment may name (node/assignment.py MAX_BLOB_BYTES): a larger silo
#: could never be trained, so `data add` refuses it
MAX_SILO_BYTES: Final = 8 << 30
_READ_CHUNK: Final = 1 << 20


class SiloError(NodeError):
    """A silo that cannot be attached or read; one line. ``code`` names the rule (the protocol's
    DatasetError codes, plus too_few_samples, too_many_samples, too_large, bad_subset, bad_schema,
    not_classification, bad_blob, no_silo, bad_index)."""

    def __init__(self, message: str, *, code: str = "bad_dataset") -> None:
        super().__init__(" ".join(message.split()))
        self.code = code


# --------------------------------------------------------------------------- reading a silo


def load_silo(path: Path, schema: SiloSchema, *, keep: int | None = None, seed: int = SUBSET_SEED) -> Arrays:
    """The silo at ``path`` (.npz, or CSV with a header row and ``schema.label_column``), checked
    against the job's model with the protocol's rules and its sample bounds.

    ``keep``: keep a subset of that many rows (``--subset N``), the same rows every time for the
    same file and ``seed``, in file order. Raises SiloError with one line.
    """
    import numpy as np
    from gpuflex.protocol.modelspec import ModelSpec

    what = f"silo {path}"
    try:
        spec = ModelSpec.from_dict(schema.model_spec)
    except ProtocolError as exc:
        raise SiloError(f"job {schema.job_id}: the hub's model spec is not one this node builds ({exc})",
                        code="bad_schema") from None
    if keep is not None and keep < 1:
        raise SiloError(f"--subset {keep}: must be at least 1", code="bad_subset")
    try:
        check_dataset_file(path, "silo")
        x, y = read_arrays(path, label_column=schema.label_column, what=what)
        arrays = validate_arrays(x, y, spec, what=what)
    except DatasetError as exc:
        raise SiloError(str(exc), code=exc.code) from None
    n = len(arrays)
    if keep is not None:
        if keep > n:
            raise SiloError(f"{what}: --subset {keep} asks for more rows than the file holds ({n})",
                            code="bad_subset")
        if keep < n:
            rows = np.sort(np.random.default_rng([seed, n]).permutation(n)[:keep])
            arrays = Arrays(np.ascontiguousarray(arrays.x[rows]), np.ascontiguousarray(arrays.y[rows]))
            n = keep
    if n < schema.min_samples:
        raise SiloError(f"{what}: {n} samples; job {schema.job_id} takes at least {schema.min_samples} per silo",
                        code="too_few_samples")
    row_bytes = (arrays.x.nbytes + arrays.y.nbytes) / max(n, 1)
    if arrays.x.nbytes + arrays.y.nbytes + (1 << 20) > MAX_SILO_BYTES:
        fits = int((MAX_SILO_BYTES - (1 << 20)) // row_bytes)
        raise SiloError(f"{what}: {n} samples encode to more than {MAX_SILO_BYTES >> 30} GiB, the most one "
                        f"chunk may be; pass --subset {min(fits, schema.max_samples)} to keep fewer rows",
                        code="too_large")
    if n > schema.max_samples:
        raise SiloError(
            f"{what}: {n} samples; job {schema.job_id} takes at most {schema.max_samples} per silo: "
            f"pass --subset {schema.max_samples} to keep that many rows (seeded: the same rows every time)",
            code="too_many_samples",
        )
    return arrays


def label_histogram(arrays: Arrays, outputs: int) -> tuple[int, ...]:
    """Samples per label 0..outputs-1 (classification only: labels validated into that range)."""
    import numpy as np

    y: np.ndarray = arrays.y
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise SiloError("a label histogram needs a classification job (one whole-number label per sample)",
                        code="not_classification")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= outputs):
        raise SiloError(f"labels outside 0..{outputs - 1}: no histogram", code="bad_labels")
    return tuple(int(c) for c in np.bincount(y, minlength=outputs))


# --------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class SiloRecord:
    """One job's silo, as index.json keeps it."""

    job_id: str
    sha256: str
    size: int
    samples: int
    source: str  # the operator's file, as given to `data add` (resolved)
    added_at: float
    histogram_shared: bool


@dataclass(frozen=True)
class SiloBlob:
    """An encoded silo written to the store and not yet in the index (``SiloStore.write_blob``)."""

    sha256: str
    size: int
    samples: int
    path: Path


def is_blob_id(text: object) -> bool:
    return isinstance(text, str) and BLOB_ID_RE.fullmatch(text) is not None


class SiloStore:
    """This node's silos under ``root`` (``<data dir>/silos``). Every call reads the index from
    disk: another process (``gpuflex-node data add``) may have changed it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # ---- paths and reading

    def blob_path(self, sha256: str) -> Path:
        if not is_blob_id(sha256):
            raise SiloError(f"not a blob id: {sha256[:80]!r}", code="bad_blob")
        return self.root / f"{sha256}{BLOB_SUFFIX}"

    def has_blob(self, sha256: str) -> bool:
        """The blob ``sha256`` is one of this node's silos (its file is here)."""
        return is_blob_id(sha256) and self.blob_path(sha256).is_file()

    def blob_ids(self) -> frozenset[str]:
        """The silo blobs on this node's disk (one directory listing)."""
        try:
            names = [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return frozenset()
        return frozenset(n[: -len(BLOB_SUFFIX)] for n in names
                         if n.endswith(BLOB_SUFFIX) and is_blob_id(n[: -len(BLOB_SUFFIX)]))

    def read_blob(self, sha256: str, size: int | None = None) -> bytearray:
        """The blob's bytes, checked against its size (when given) and its SHA-256."""
        path = self.blob_path(sha256)
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                have = os.fstat(f.fileno()).st_size
                if size is not None and have != size:
                    raise SiloError(f"silo blob {sha256[:12]}… holds {have} bytes, {size} expected: "
                                    "truncated or replaced; `gpuflex-node data add` it again", code="bad_blob")
                buf = bytearray(have)
                view = memoryview(buf)
                at = 0
                while at < have:
                    got = f.readinto(view[at : at + _READ_CHUNK])
                    if not got:
                        break
                    digest.update(view[at : at + got])
                    at += got
                view.release()
        except FileNotFoundError:
            raise SiloError(f"silo blob {sha256[:12]}… is not on this node (removed?)", code="no_silo") from None
        except OSError as exc:
            raise SiloError(f"silo blob {sha256[:12]}…: cannot read it ({exc.strerror or exc})",
                            code="bad_blob") from None
        if at != have or digest.hexdigest() != sha256:
            raise SiloError(f"silo blob {sha256[:12]}… does not match its SHA-256: tampered or damaged; "
                            "not trained (`gpuflex-node data add` it again)", code="bad_blob")
        return buf

    # ---- the index

    def _index_path(self) -> Path:
        return self.root / INDEX_FILE

    def _read_index(self) -> dict[str, Any]:
        empty: dict[str, Any] = {"version": INDEX_VERSION, "silos": {}, "superseded": {}, "retired": {}}
        path = self._index_path()
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return empty
        except (OSError, ValueError) as exc:
            raise SiloError(f"silo index {path} is unreadable ({exc}); move it away and add the silos again",
                            code="bad_index") from None
        if not isinstance(doc, dict) or not all(isinstance(doc.get(k, {}), dict)
                                                for k in ("silos", "superseded", "retired")):
            raise SiloError(f"silo index {path} is not a silo index; move it away and add the silos again",
                            code="bad_index")
        return empty | doc

    def _write_index(self, doc: dict[str, Any]) -> None:
        write_private_file(self._index_path(), json.dumps(doc, indent=1, sort_keys=True) + "\n")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The index, under the store's lock; written back (when changed) if the block ends
        without error."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+b", buffering=0) as f:
            _lock(f)
            try:
                doc = self._read_index()
                before = json.dumps(doc, sort_keys=True)
                yield doc
                if json.dumps(doc, sort_keys=True) != before:
                    self._write_index(doc)
            finally:
                _unlock(f)

    @staticmethod
    def _record(job_id: str, raw: Any) -> SiloRecord | None:
        try:
            return SiloRecord(job_id=job_id, sha256=str(raw["sha256"]), size=int(raw["size"]),
                              samples=int(raw["samples"]), source=str(raw.get("source", "")),
                              added_at=float(raw.get("added_at", 0.0)),
                              histogram_shared=bool(raw.get("histogram_shared", False)))
        except (KeyError, TypeError, ValueError):
            return None

    def get(self, job_id: str) -> SiloRecord | None:
        raw = self._read_index()["silos"].get(job_id)
        return None if raw is None else self._record(job_id, raw)

    def records(self) -> list[SiloRecord]:
        """Every job's silo, by job id."""
        silos = self._read_index()["silos"]
        out = [self._record(job, raw) for job, raw in sorted(silos.items())]
        return [r for r in out if r is not None]

    def retired(self) -> dict[str, str]:
        """Blob id -> job of the silos this node no longer holds (removed by the operator, or
        replaced and pruned): an assignment naming one is refused rather than fetched from the hub."""
        if not self.root.is_dir():
            return {}
        held = self.blob_ids()
        return {str(sha): str(job) for sha, job in self._read_index()["retired"].items() if sha not in held}

    def retired_job(self, sha256: str) -> str | None:
        """The job whose silo ``sha256`` was, if it is retired (``retired``)."""
        return self.retired().get(sha256)

    # ---- changes

    def write_blob(self, arrays: Arrays) -> SiloBlob:
        """Encode ``arrays`` and write the blob (0600, atomic); not in the index yet (``commit``)."""
        from gpuflex.protocol.dataset import encode_arrays

        blob = encode_arrays(arrays)
        sha = hashlib.sha256(blob).hexdigest()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.blob_path(sha)
        write_private_file(path, blob)
        return SiloBlob(sha256=sha, size=len(blob), samples=len(arrays), path=path)

    def commit(self, job_id: str, blob: SiloBlob, source_path: Path | str, shared_histogram: bool) -> SiloRecord:
        """Make ``blob`` the silo of ``job_id`` (replacing its earlier one, whose blob stays until
        ``prune``)."""
        record = SiloRecord(job_id=job_id, sha256=blob.sha256, size=blob.size, samples=blob.samples,
                            source=str(source_path), added_at=time.time(), histogram_shared=shared_histogram)
        with self._locked() as doc:
            old = doc["silos"].get(job_id)
            raw = asdict(record)
            del raw["job_id"]
            doc["silos"][job_id] = raw
            doc["superseded"].pop(blob.sha256, None)
            doc["retired"].pop(blob.sha256, None)
            if isinstance(old, dict) and old.get("sha256") not in (None, blob.sha256):
                doc["superseded"][str(old["sha256"])] = job_id
        return record

    def add(self, job_id: str, arrays: Arrays, source_path: Path | str, shared_histogram: bool) -> SiloRecord:
        """Write the blob and commit it as ``job_id``'s silo in one go."""
        return self.commit(job_id, self.write_blob(arrays), source_path, shared_histogram)

    def drop_blob(self, sha256: str) -> bool:
        """Delete a written blob that no record and no superseded entry names (a refused
        registration); True when it was deleted."""
        with self._locked() as doc:
            named = {str(r.get("sha256")) for r in doc["silos"].values() if isinstance(r, dict)}
            if sha256 in named or sha256 in doc["superseded"]:
                return False
            self.blob_path(sha256).unlink(missing_ok=True)
        return True

    def remove(self, job_id: str) -> SiloRecord | None:
        """Forget ``job_id``'s silo and delete its blob (unless another job's silo is the same
        bytes); the node stops training it at once. None when the job has none."""
        if not self.root.is_dir():
            return None
        with self._locked() as doc:
            raw = doc["silos"].pop(job_id, None)
            record = self._record(job_id, raw) if raw is not None else None
            if record is None:
                return None
            # a superseded blob of the same job goes too: the operator wants the job's data out
            gone = [record.sha256] + [s for s, j in doc["superseded"].items() if j == job_id]
            named = {str(r.get("sha256")) for r in doc["silos"].values() if isinstance(r, dict)}
            for sha in gone:
                doc["superseded"].pop(sha, None)
                if sha not in named:
                    self.blob_path(sha).unlink(missing_ok=True)
                    _retire(doc, sha, job_id)
        return record

    def prune(self, *, now: float | None = None) -> int:
        """Delete superseded blobs, and blobs or temp files no record names older than
        STRAY_AFTER_S (an interrupted ``data add``); the number of files deleted."""
        if not self.root.is_dir():
            return 0
        now = time.time() if now is None else now
        deleted = 0
        with self._locked() as doc:
            named = {str(r.get("sha256")) for r in doc["silos"].values() if isinstance(r, dict)}
            for sha, job in list(doc["superseded"].items()):
                del doc["superseded"][sha]
                if sha not in named and is_blob_id(sha):
                    with contextlib.suppress(FileNotFoundError):
                        self.blob_path(sha).unlink()
                        deleted += 1
                    _retire(doc, sha, str(job))
            for p in self.root.iterdir():
                stem = p.name[: -len(BLOB_SUFFIX)] if p.name.endswith(BLOB_SUFFIX) else None
                stray = (stem is not None and stem not in named) or (p.name.startswith(".") and p.name.endswith(".tmp"))
                if not stray:
                    continue
                with contextlib.suppress(OSError):
                    if now - p.stat().st_mtime > STRAY_AFTER_S:
                        p.unlink()
                        deleted += 1
        return deleted


def _retire(doc: dict[str, Any], sha: str, job_id: str) -> None:
    retired: dict[str, str] = doc["retired"]
    retired[sha] = job_id
    while len(retired) > MAX_RETIRED:
        del retired[next(iter(retired))]


def _lock(f: IO[bytes]) -> None:
    if sys.platform == "win32":
        import msvcrt

        f.seek(0)
        msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
        return
    import fcntl

    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def _unlock(f: IO[bytes]) -> None:
    with contextlib.suppress(OSError):
        if sys.platform == "win32":
            import msvcrt

            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
            return
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


__all__ = [
    "SiloBlob",
    "SiloError",
    "SiloRecord",
    "SiloStore",
    "label_histogram",
    "load_silo",
]
