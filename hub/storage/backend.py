"""The one switch between the hub's two databases: SQLite in the data folder, or the PostgreSQL
database a URL names (``--store``); and between its two blob stores: the folder, or the S3 bucket
a URL names (``--blobs``). The hub (hub/server/app.py) and the token commands
(hub/storage/token_admin.py) open their database here, and nowhere else."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .blobs import BlobStore, BlobStoreUnavailable, check_s3_options, parse_blobs_url
from .db import Database
from .store import Store
from .store_sqlite import SqliteStore

if TYPE_CHECKING:
    from ..base.config import HubConfig

#: the SQLite database's file in a hub's data folder (HubConfig.db_path)
SQLITE_FILE = "hub.sqlite3"


def open_store(data_dir: Path, store: str | None) -> tuple[Database, Store]:
    """The hub's database and the `Store` on it: SQLite in ``data_dir`` (created and migrated), or
    the PostgreSQL database the URL ``store`` names (its schema created or migrated;
    StoreUnavailable, one line, when it cannot be used). Close the database when done."""
    if store is None:
        db = Database(Path(data_dir) / SQLITE_FILE)
        return db, SqliteStore(db)
    from .store_postgres import PgDatabase, PostgresStore  # psycopg: the postgres extra

    pg = PgDatabase(store)
    return pg, PostgresStore(pg)


def open_blob_store(config: HubConfig) -> BlobStore:
    """The hub's blob store: the folder ``config.blob_dir``, or the bucket ``config.blobs`` names
    (that folder then its working area and read cache). BlobStoreUnavailable, one line, when the
    bucket cannot be used (checked here, at start-up)."""
    if config.blobs is None:
        blobs = BlobStore(config.blob_dir)
        blobs.pack()  # opened here: a pack a newer hub wrote is refused at start-up (PackError)
        return blobs
    check_s3_options(config.blobs, config.s3_endpoint, config.s3_region)
    try:
        from .blobs_s3 import S3BlobStore  # boto3: the s3 extra
    except ModuleNotFoundError as exc:
        if exc.name not in ("boto3", "botocore"):
            raise
        raise BlobStoreUnavailable(f"--blobs {config.blobs} needs boto3: pip install 'gpuflex[s3]'",
                                   code="blob_store_unavailable") from None
    bucket, prefix = parse_blobs_url(config.blobs)
    return S3BlobStore(config.blob_dir, bucket=bucket, prefix=prefix, endpoint=config.s3_endpoint,
                       region=config.s3_region, cache_bytes=config.blob_cache_bytes)
