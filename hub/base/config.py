"""Hub configuration: one frozen, keyword-only dataclass built by the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class HubConfig:
    """Everything a hub needs to start. Paths live under `data_dir`.

    Times are seconds. Sizes are bytes.
    """

    data_dir: Path
    #: where the hub's state lives: None = SQLite in data_dir (hub.sqlite3); a postgresql:// URL =
    #: that PostgreSQL database (hub/storage/store_postgres.py). Key and audit log stay in data_dir (blobs too,
    #: unless `blobs` names a bucket).
    store: str | None = None
    #: where committed blobs live: None = the folder blobs/ in data_dir; "s3://BUCKET[/PREFIX]" =
    #: that S3-compatible bucket (hub/storage/blobs_s3.py; credentials from AWS_ACCESS_KEY_ID and
    #: AWS_SECRET_ACCESS_KEY), blobs/ then only the working area and a read cache
    blobs: str | None = None
    #: the bucket's S3-compatible server (None: AWS S3) and region
    s3_endpoint: str | None = None
    s3_region: str | None = None
    #: the most bytes of blobs from the bucket the local read cache keeps (least recently used go first)
    blob_cache_bytes: int = 8 << 30
    host: str = "127.0.0.1"
    port: int = 8470
    tls_cert: Path | None = None
    tls_key: Path | None = None
    long_poll_max_s: float = 30.0
    #: an assignment deadline is max(min_deadline_s, expected_s * deadline_slack)
    min_deadline_s: float = 30.0
    #: a heartbeat never pushes a deadline past issued_at + max_assignment_s
    max_assignment_s: float = 6 * 3600.0
    #: what a node is told to wait between polls when there is nothing to do
    node_poll_s: float = 5.0
    #: how often expired assignments and settled replicas are swept
    sweep_interval_s: float = 1.0
    replay_window_s: float = 300.0
    #: body limit for signed control messages (register, work, heartbeat, abandon)
    max_message_bytes: int = 1 << 20
    #: a request whose handler waits this long for body bytes and gets none is answered 408 and its
    #: connection closed (hub/server/bodywatch.py): a client that sends a head and then nothing holds nothing
    body_idle_timeout_s: float = 15.0
    #: limit for one uploaded dataset file and for a whole job submission
    max_dataset_bytes: int = 2 << 30
    max_spec_bytes: int = 64 << 10
    #: a node counts as online when seen within this many seconds
    online_window_s: float = 90.0
    #: EMA weight of the newest throughput observation: shards follow the speeds seen in the last
    #: round (a node at half speed gets about a third of a two-node round by its third round)
    throughput_alpha: float = 0.7
    #: worker threads for upload file work (manifest check, fsync, rename)
    io_threads: int = 16
    #: torch intra-op threads for aggregation/evaluation (memory-bound slices: 1 is fastest on a busy box);
    #: None leaves torch's setting alone
    torch_threads: int | None = 1
    #: a background loop that died starts again after this delay (doubling up to 30 s)
    loop_restart_s: float = 1.0
    #: a pipeline stage whose node sends no report for this long is lost: the hub re-plans the
    #: job's pipeline (a new generation from its committed step) over the nodes online
    stage_timeout_s: float = 30.0
    #: a node that joins while a pipelined job runs is planned in (right after a committed step)
    #: only when the planner predicts a step at least this much faster with it
    replan_gain: float = 0.2

    # -- Sybil and collusion defences (docs/verification.md: Sybils and collusion) -----
    #: an address block is the node's IPv4 /ipv4_block_prefix or IPv6 /ipv6_block_prefix network
    ipv4_block_prefix: int = 24
    ipv6_block_prefix: int = 48
    #: replicas of one shard never go to two nodes of one address block or one operator;
    #: False is for a single-machine test bed only (every node shares 127.0.0.1)
    separate_replicas: bool = True
    #: new identities (not re-registrations) per address block, and in all, per registration_window_s
    registrations_per_block: int = 5
    registrations_global: int = 200
    registration_window_s: float = 3600.0
    #: a node needs this age (since registration) before it can be trusted, whatever its run
    trust_min_age_s: float = 3600.0
    #: identities of one block (or operator) younger than trust_min_age_s; a new one beyond is refused
    probation_per_block: int = 8
    #: after a ban, no new identity registers from the banned node's block or operator for this long
    ban_cooldown_s: float = 7 * 86400.0
    #: register only with an enrollment token (`gpuflex-hub token create --role enroll`)
    require_enrollment: bool = False
    #: the self-reported benchmark seeds the throughput guess, at most this many samples/s
    bench_seed_max_sps: float = 5000.0
    #: a node that has delivered nothing gets at most this many chunks; each delivery doubles it
    unproven_max_chunks: int = 4
    #: heartbeats extend a deadline only on new steps, up to issued_at + this x the first window
    progress_extension_max: float = 4.0
    #: a node whose assignment expired without delivery waits this long (doubling) for new work
    stall_backoff_s: float = 30.0

    @property
    def db_path(self) -> Path:
        return self.data_dir / "hub.sqlite3"

    @property
    def key_path(self) -> Path:
        return self.data_dir / "hub.key"

    @property
    def blob_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def audit_log_path(self) -> Path:
        return self.data_dir / "audit.jsonl"

    @property
    def url_path(self) -> Path:
        return self.data_dir / "hub.url"
