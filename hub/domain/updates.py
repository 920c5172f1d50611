"""A round's updates as the round engine reads them: their blobs opened without a copy, and
verification's view of each (hub/policy/verification.py ``UpdateRecord``)."""

from __future__ import annotations

import contextlib
import math
import mmap
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpuflex.protocol.modelspec import param_count
from gpuflex.protocol.tensors import decode_state, encode_state
from torch import Tensor

from ..model.job import JobState, ShardState, UpdateLayout, UpdateState
from ..model.node import NodeState
from ..policy import verification as vf
from ..policy.fingerprints import Fingerprint
from ..policy.pages import readonly_mapping
from ..policy.referee import referee_grid_ok
from ..storage.blobs import HOT_BLOB_MAX, BlobStore


@contextlib.contextmanager
def open_deltas(blobs: BlobStore, shas: Sequence[str],
                layout: UpdateLayout | None = None) -> Iterator[list[dict[str, Tensor]]]:
    """Zero-copy views of update blobs (the hub's in-memory copy of a small one, else a
    read-only mmap, registered with the PageReleasers while open), closed on exit. With a
    ``layout`` whose encoding is not fp32, each update is decoded into the model's dense tensors
    (fp16, int8, topk and sign are not the model's bytes): in memory for a model of up to
    HOT_BLOB_MAX, else written to an unnamed temporary file (no fsync: it is gone when closed,
    or with the process) and mapped read-only like an fp32 update, so a round of many encoded
    updates streams through aggregation in O(model) memory as fp32 ones do, instead of holding
    every dense update at once."""
    maps: list[mmap.mmap] = []
    files: list[Any] = []
    states: list[dict[str, Tensor]] = []
    registered = contextlib.ExitStack()
    spill = layout if layout is not None and not layout.encoding.identity and layout.dense_bytes > HOT_BLOB_MAX \
        else None

    def mapped(fh: Any) -> mmap.mmap:
        files.append(fh)
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        maps.append(mm)
        registered.enter_context(readonly_mapping(mm))
        return mm

    try:
        for sha in shas:
            if spill is not None:
                states.append(decode_state(mapped(_spilled(blobs, sha, spill))))
                continue
            small = blobs.small(sha)
            source = small if small is not None else mapped(open(blobs.path(sha), "rb"))
            states.append(_dense(decode_state(source), layout))
        yield states
    finally:
        registered.close()  # out of the registry before anything is closed
        del states  # drop tensor views before closing their buffers
        for mm in maps:
            with contextlib.suppress(BufferError):
                mm.close()
        for fh in files:
            fh.close()


def _spilled(blobs: BlobStore, sha: str, layout: UpdateLayout) -> Any:
    """An unnamed temporary file holding the encoded update ``sha`` decoded to the model's
    tensors (a GFT1 blob). The encoded blob is read and let go here, so a round of N updates
    holds N open files, not 2N."""
    small = blobs.small(sha)
    if small is not None:
        dense = encode_state(layout.dense(decode_state(small)))
    else:
        with open(blobs.path(sha), "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            dense = encode_state(layout.dense(decode_state(mm)))  # a copy: no view of mm outlives this
    tmp = tempfile.TemporaryFile(dir=blobs.tmp)
    try:
        tmp.write(dense)
        tmp.flush()
    except BaseException:
        tmp.close()
        raise
    return tmp


def _dense(wire: dict[str, Tensor], layout: UpdateLayout | None) -> dict[str, Tensor]:
    return wire if layout is None or layout.encoding.identity else layout.dense(wire)


def update_records(job: JobState, nodes: Mapping[str, NodeState], shard_of: Mapping[str, ShardState], ups: Sequence[UpdateState],
             deltas: Sequence[Mapping[str, Tensor]],
             fingerprints: Mapping[str, Fingerprint] | None = None) -> list[vf.UpdateRecord]:
    """Verification's view of updates. Speed: max(benchmark, delivered EMA) is an upper bound of
    the node's training speed; peak FLOP/s and the model size give the physical minimum time.
    ``fingerprints``: update id -> its fingerprint, where one was taken."""
    params = param_count(job.spec.model)
    out = []
    for u, d in zip(ups, deltas, strict=True):
        node = nodes.get(u.node_id)
        c = u.commitment
        path = (math.fsum(c.norms) if c is not None and job.layout.encoding.identity
                and referee_grid_ok(c, job.spec.train.steps(shard_of[u.id].samples)) else None)
        out.append(vf.UpdateRecord(
            update_id=u.id, node_id=u.node_id, shard_id=u.shard_id,
            samples_claimed=u.sample_count, shard_samples=shard_of[u.id].samples,
            loss=u.loss, train_s=u.train_s,
            node_samples_per_s=max(node.bench_sps, node.ema_sps) if node else 0.0, delta=d,
            elapsed_s=u.elapsed_s, peak_flops=node.peak_flops if node else 0.0,
            param_count=params,
            local_epochs=job.spec.train.processed(shard_of[u.id].samples) / max(shard_of[u.id].samples, 1),
            path_length=path, lr_scale=job.lr_scale(shard_of[u.id].samples), sha=u.sha,
            fingerprint=fingerprints.get(u.id) if fingerprints else None,
        ))
    return out
