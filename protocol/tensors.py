"""The GFT1 tensor codec: one contiguous, aligned byte layout for state dicts.

Layout (little-endian)::

    0   4 bytes  magic b"GFT1"
    4   u16      codec version (1)
    6   u16      flags (0)
    8   u32      header length H
    12  u32      reserved (0)
    16  H bytes  msgpack header {"tensors": [[name, dtype, shape, offset, nbytes], ...],
                                 "data_bytes": D}
        pad      zeros up to data_start = align64(16 + H)
        D bytes  tensor data; each tensor at data_start + offset, offset % 64 == 0

``offset`` is relative to ``data_start`` so the header never depends on its own
length. The buffer ends exactly at ``data_start + D``. Everything in the header
is validated before any data is touched; decoding is zero-copy
(``torch.frombuffer`` views over the caller's buffer).
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import re
import struct
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, cast

import msgpack
import numpy as np
import torch

if TYPE_CHECKING:
    from typing_extensions import Buffer as _BufferProto

from .errors import DecodeError, TensorError

MAGIC: Final = b"GFT1"
CODEC_VERSION: Final = 1
PREFIX: Final = struct.Struct("<4sHHII")
ALIGN: Final = 64
MAX_TENSORS: Final = 16_384
MAX_HEADER_BYTES: Final = 4 << 20
MAX_NAME_LEN: Final = 256
MAX_NDIM: Final = 16
DEFAULT_MAX_TOTAL_BYTES: Final = 8 << 30
NAME_RE: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,256}")
BLOB_ID_RE: Final = re.compile(r"[0-9a-f]{64}")

DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: Final[dict[torch.dtype, str]] = {v: k for k, v in DTYPES.items()}
#: the codec's dtypes numpy holds as they are (all but bfloat16): decode_state views them through
#: numpy, calling no torch operator. Each torch operator releases the GIL, and a worker thread then
#: waits for it while the event loop runs: 1,000 small updates took 11.5 s to decode beside a busy
#: thread with torch's views, 0.19 s through numpy (15 and 18 ms alone).
NUMPY_DTYPES: Final[dict[str, type[np.generic]]] = {
    "float32": np.float32, "float16": np.float16, "float64": np.float64, "int8": np.int8, "int16": np.int16,
    "int32": np.int32, "int64": np.int64, "uint8": np.uint8, "bool": np.bool_,
}
ITEMSIZE: Final[dict[str, int]] = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}

Buffer = bytes | bytearray | memoryview | mmap.mmap


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor must look like: name, dtype name (``"float32"``), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


Manifest = tuple[TensorSpec, ...]


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where a tensor's bytes live, relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


def _byte_view(buf: Buffer) -> memoryview:
    """The buffer as flat bytes (a memoryview of any format or shape is cast)."""
    view = memoryview(buf)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _check_bool(view: memoryview, info: TensorInfo, start: int) -> None:
    """A bool tensor's bytes hold only 0 and 1 (decode_state, check_blob)."""
    if np.frombuffer(view, dtype=np.uint8, count=info.nbytes, offset=start).max() > 1:
        raise TensorError(f"tensor {info.name!r}: bool data holds values other than 0/1")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def sha256_hex(data: Buffer) -> str:
    """Lowercase hex sha256 of ``data``: the blob id of content-addressed bytes."""
    return hashlib.sha256(data).hexdigest()


def is_blob_id(s: object) -> bool:
    """True for 64 lowercase hex characters."""
    return isinstance(s, str) and BLOB_ID_RE.fullmatch(s) is not None


def dtype_name(dtype: torch.dtype) -> str:
    """The codec's name for a torch dtype; TensorError if it is not on the whitelist."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise TensorError(f"dtype {dtype} is not supported; allowed: {', '.join(DTYPES)}")
    return name


def _check_name(name: object) -> str:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise TensorError(
            f"tensor name {name!r:.60} is invalid: use 1..{MAX_NAME_LEN} chars of [A-Za-z0-9_.:/-]"
        )
    return name


# ---------------------------------------------------------------------------
# Encode.


def _wire_tensor(name: str, value: object, *, to_cpu: bool = True) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TensorError(f"tensor {name!r}: expected a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_quantized:
        raise TensorError(f"tensor {name!r}: only dense tensors can be encoded")
    dtype_name(value.dtype)
    t = value.detach()
    if not to_cpu:
        return t
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


@dataclass(frozen=True, slots=True)
class _Plan:
    """Where everything goes: prefix + header bytes, then each tensor at its offset."""

    head: bytes  # prefix, msgpack header and the zero padding up to data_start
    tensors: list[tuple[int, int, torch.Tensor]]  # (absolute offset, nbytes, tensor)
    total: int


def _plan(state: Mapping[str, torch.Tensor], *, to_cpu: bool) -> _Plan:
    if len(state) > MAX_TENSORS:
        raise TensorError(f"{len(state)} tensors exceeds the limit of {MAX_TENSORS}")
    tensors: list[torch.Tensor] = []
    entries: list[list[object]] = []
    offsets: list[int] = []  # relative to the data section
    end = 0
    for name, value in state.items():
        _check_name(name)
        t = _wire_tensor(name, value, to_cpu=to_cpu)
        shape = [int(d) for d in t.shape]
        if len(shape) > MAX_NDIM:
            raise TensorError(f"tensor {name!r}: more than {MAX_NDIM} dimensions")
        offset = _align(end)
        nbytes = t.numel() * t.element_size()
        entries.append([name, DTYPE_NAMES[t.dtype], shape, offset, nbytes])
        offsets.append(offset)
        tensors.append(t)
        end = offset + nbytes
    header: bytes = msgpack.packb({"tensors": entries, "data_bytes": end}, use_bin_type=True)
    if len(header) > MAX_HEADER_BYTES:
        raise TensorError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    data_start = _align(PREFIX.size + len(header))
    head = PREFIX.pack(MAGIC, CODEC_VERSION, 0, len(header), 0) + header
    head += bytes(data_start - len(head))
    placed = [(data_start + off, t.numel() * t.element_size(), t) for off, t in zip(offsets, tensors, strict=True)]
    return _Plan(head, placed, data_start + end)


def max_encoded_size(manifest: Manifest) -> int:
    """The most bytes an encoder can make of a state dict with ``manifest``'s tensors, in any
    order: every tensor's data padded to the alignment, and a header whose offsets and sizes
    take the longest msgpack integers. What a receiver may refuse beyond before reading a byte."""
    widest = (1 << 64) - 1  # msgpack's longest integer encoding (9 bytes)
    entries = [[spec.name, spec.dtype, list(spec.shape), widest, widest] for spec in manifest]
    header: bytes = msgpack.packb({"tensors": entries, "data_bytes": widest}, use_bin_type=True)
    data = sum(_align(math.prod(spec.shape) * ITEMSIZE[spec.dtype]) for spec in manifest)
    return _align(PREFIX.size + len(header)) + data


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """Encode a state dict as GFT1 bytes (one copy of each tensor's data into a new buffer).

    For repeated encodes (a node's update every round) prefer :class:`StateEncoder`,
    which reuses its buffer.
    """
    plan = _plan(state, to_cpu=True)
    parts: list[bytes | memoryview] = [plan.head]
    position = len(plan.head)
    for offset, nbytes, t in plan.tensors:
        if offset > position:
            parts.append(bytes(offset - position))
        if nbytes:
            # A flat uint8 view of the tensor's own memory (bf16 included): no copy here.
            array = t.reshape(-1).view(torch.uint8).numpy()
            parts.append(memoryview(cast("_BufferProto", array)))
        position = offset + nbytes
    # bytes.join sizes the result once and copies each part into it: one pass.
    return b"".join(parts)


class StateEncoder:
    """Encodes state dicts into one buffer it owns and reuses.

    A fresh 100 MB buffer costs more in page faults (the kernel zeroing each new page)
    than the copy into it, so a node that encodes an update every round keeps one of
    these. Tensors on an accelerator are copied straight into the buffer (no ``.cpu()``
    temporary), and non-contiguous tensors are laid out by the same copy.

    The view returned by :meth:`encode` is valid until the next call: a caller that
    keeps the bytes must copy them. The buffer grows when a larger state dict arrives;
    views handed out earlier keep the old buffer alive and unchanged.
    """

    def __init__(self) -> None:
        self._buf: mmap.mmap | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else len(self._buf)

    def encode(self, state: Mapping[str, torch.Tensor]) -> memoryview:
        plan = _plan(state, to_cpu=False)
        if self._buf is None or plan.total > len(self._buf):
            # Anonymous memory is page-aligned, so every 64-byte-aligned tensor offset is
            # aligned in memory too (a bytearray's data sits 16 bytes into its block, which
            # makes the copy ~1.7x slower here). Never resized in place: old views stay valid.
            self._buf = mmap.mmap(-1, max(plan.total, 1))
        buf = self._buf
        buf[: len(plan.head)] = plan.head
        position = len(plan.head)
        for offset, nbytes, t in plan.tensors:
            if offset > position:
                buf[position:offset] = bytes(offset - position)  # padding left by an earlier encode
            if nbytes:
                dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
                dst.view(t.dtype).view(t.shape).copy_(t)
            position = offset + nbytes
        return memoryview(buf)[: plan.total]


# ---------------------------------------------------------------------------
# Decode.


def _parse(
    buf: Buffer, max_total_bytes: int, declared_total: int | None = None
) -> tuple[int, list[TensorInfo]]:
    """Validate prefix and header; returns (data_start, entries). Touches no tensor data.

    With ``declared_total``, ``buf`` may be only the blob's first bytes (at least the prefix
    and the header) and the blob's length is checked against ``declared_total`` instead.
    """
    if not isinstance(buf, (bytes, bytearray, memoryview, mmap.mmap)):
        raise DecodeError(f"tensor blob: expected bytes, got {type(buf).__name__}")
    view = _byte_view(buf)
    available = view.nbytes
    total = available if declared_total is None else declared_total
    if available > total:
        raise DecodeError(f"tensor blob: {available} bytes given for a blob of {total}")
    if total > max_total_bytes:
        raise TensorError(f"tensor blob of {total} bytes exceeds the limit of {max_total_bytes}")
    if available < PREFIX.size:
        raise DecodeError(f"tensor blob: {available} bytes is shorter than the {PREFIX.size}-byte prefix")
    magic, version, flags, header_len, reserved = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise DecodeError("tensor blob: bad magic (not a GFT1 blob)")
    if version != CODEC_VERSION:
        raise DecodeError(f"tensor blob: codec version {version}, this software reads {CODEC_VERSION}")
    if flags != 0 or reserved != 0:
        raise DecodeError("tensor blob: unknown flags set")
    if header_len > MAX_HEADER_BYTES:
        raise DecodeError(f"tensor blob: header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    if PREFIX.size + header_len > available:
        raise DecodeError("tensor blob: truncated header")
    header = bytes(view[PREFIX.size : PREFIX.size + header_len])
    data_bytes, infos = (_header if header_len <= CACHED_HEADER_MAX else _header.__wrapped__)(header)
    data_start = _align(PREFIX.size + header_len)
    if any(view[PREFIX.size + header_len : min(data_start, available)]):
        raise DecodeError("tensor blob: non-zero padding after the header")
    if data_start + data_bytes != total:
        raise DecodeError(
            f"tensor blob: length {total} does not match header (expected {data_start + data_bytes})"
        )
    return data_start, list(infos)


#: headers up to this size are remembered once checked (``_header``): every update of a job, and
#: every model of it, carries the same header, which is then read and checked once
CACHED_HEADER_MAX: Final = 4096


@functools.lru_cache(maxsize=64)
def _header(raw_header: bytes) -> tuple[int, tuple[TensorInfo, ...]]:
    """A GFT1 header's (data_bytes, entries), checked: each entry's name, dtype, shape and bounds,
    no name twice, no overlap. Depends on the header's bytes alone."""
    try:
        header = msgpack.unpackb(
            raw_header,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_NAME_LEN * 4,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=MAX_TENSORS,
            max_map_len=2,
        )
    except Exception:  # any msgpack failure on hostile bytes
        raise DecodeError("tensor blob: malformed msgpack header") from None
    if not isinstance(header, dict) or set(header) != {"tensors", "data_bytes"}:
        raise DecodeError("tensor blob: header must be a map with keys tensors, data_bytes")
    raw_entries, data_bytes = header["tensors"], header["data_bytes"]
    if not isinstance(raw_entries, list):
        raise DecodeError("tensor blob: header.tensors must be a list")
    if isinstance(data_bytes, bool) or not isinstance(data_bytes, int) or data_bytes < 0:
        raise DecodeError("tensor blob: header.data_bytes must be a non-negative integer")
    infos: list[TensorInfo] = []
    names: set[str] = set()
    for index, raw in enumerate(raw_entries):
        info = _parse_entry(index, raw, data_bytes)
        if info.name in names:
            raise TensorError(f"tensor {info.name!r} appears twice in the header")
        names.add(info.name)
        infos.append(info)
    end = 0
    for info in sorted(infos, key=lambda i: i.offset):
        if info.nbytes and info.offset < end:
            raise TensorError(f"tensor {info.name!r} overlaps the previous tensor")
        end = max(end, info.offset + info.nbytes)
    return data_bytes, tuple(infos)


def _parse_entry(index: int, raw: object, data_bytes: int) -> TensorInfo:
    if not isinstance(raw, list) or len(raw) != 5:
        raise DecodeError(f"tensor blob: header entry {index} is not [name, dtype, shape, offset, nbytes]")
    name, dtype, shape, offset, nbytes = raw
    try:
        name = _check_name(name)
    except TensorError as exc:
        raise DecodeError(f"tensor blob: entry {index}: {exc}") from None
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise TensorError(f"tensor {name!r}: dtype {dtype!r:.30} not allowed; allowed: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise TensorError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} sizes")
    dims: list[int] = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < (1 << 48):
            raise TensorError(f"tensor {name!r}: shape has an invalid size {d!r:.30}")
        dims.append(d)
    offset = _entry_int(name, "offset", offset, data_bytes)
    nbytes = _entry_int(name, "nbytes", nbytes, data_bytes)
    if offset % ALIGN:
        raise TensorError(f"tensor {name!r}: offset {offset} is not {ALIGN}-byte aligned")
    numel = math.prod(dims)
    if numel * ITEMSIZE[dtype] != nbytes:
        raise TensorError(
            f"tensor {name!r}: {nbytes} bytes does not match shape {dims} of {dtype}"
        )
    if offset + nbytes > data_bytes:
        raise TensorError(f"tensor {name!r}: data runs past the end of the blob")
    return TensorInfo(name, dtype, tuple(dims), offset, nbytes)


def _entry_int(name: str, what: str, value: object, data_bytes: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= data_bytes:
        raise TensorError(f"tensor {name!r}: {what} {value!r:.30} outside the data section")
    return value


def read_header(buf: Buffer, *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> list[TensorInfo]:
    """Validate a GFT1 blob's header and return its entries, without touching data."""
    return _parse(buf, max_total_bytes)[1]


def header_span(prefix: Buffer) -> int:
    """How many leading bytes of a GFT1 blob hold its prefix and header (read from the
    first ``PREFIX.size`` bytes): what a receiver reads before it can check a manifest."""
    view = _byte_view(prefix)
    if view.nbytes < PREFIX.size:
        raise DecodeError(f"tensor blob: {view.nbytes} bytes is shorter than the {PREFIX.size}-byte prefix")
    magic, _version, _flags, header_len, _reserved = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise DecodeError("tensor blob: bad magic (not a GFT1 blob)")
    if header_len > MAX_HEADER_BYTES:
        raise DecodeError(f"tensor blob: header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    return int(PREFIX.size + header_len)


def read_header_prefix(
    prefix: Buffer, total_size: int, *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
) -> list[TensorInfo]:
    """``read_header`` for a blob of ``total_size`` bytes of which only the first bytes
    (at least ``header_span``) have arrived: a streamed upload is checked before its data."""
    return _parse(prefix, max_total_bytes, total_size)[1]


def decode_state(
    buf: Buffer, *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
) -> dict[str, torch.Tensor]:
    """Decode GFT1 bytes into tensors that VIEW ``buf`` (no copy).

    The tensors share memory with ``buf``; when ``buf`` is read-only (bytes,
    read-only mmap) they must not be written to: ``clone()`` first, or use
    ``module.load_state_dict`` which copies.
    """
    data_start, infos = _parse(buf, max_total_bytes)
    view = _byte_view(buf)
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # frombuffer warns about read-only buffers; we document the no-write rule instead.
        warnings.simplefilter("ignore", UserWarning)
        for info in infos:
            dtype = DTYPES[info.dtype]
            if info.nbytes == 0:
                out[info.name] = torch.empty(info.shape, dtype=dtype)
                continue
            start = data_start + info.offset
            count = info.nbytes // ITEMSIZE[info.dtype]
            if dtype == torch.bool:
                _check_bool(view, info, start)
            as_numpy = NUMPY_DTYPES.get(info.dtype)
            if as_numpy is not None:
                out[info.name] = torch.from_numpy(
                    np.frombuffer(view, dtype=as_numpy, count=count, offset=start).reshape(info.shape))
            else:  # bfloat16
                out[info.name] = torch.frombuffer(view, dtype=dtype, count=count, offset=start).view(info.shape)
    return out


def load_state_file(
    path: str | os.PathLike[str], *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
) -> dict[str, torch.Tensor]:
    """Decode a GFT1 file through a read-only mmap (the tensors keep the map alive)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            raise DecodeError(f"tensor file {path} is empty")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return decode_state(mapped, max_total_bytes=max_total_bytes)


# ---------------------------------------------------------------------------
# Manifests and checks.


def manifest_of(state: Mapping[str, torch.Tensor]) -> Manifest:
    """The manifest (names, dtypes, shapes) of a state dict, in its order."""
    return tuple(
        TensorSpec(_check_name(name), dtype_name(t.dtype), tuple(int(d) for d in t.shape))
        for name, t in state.items()
    )


def check_manifest(state_or_buf: Mapping[str, torch.Tensor] | Buffer, manifest: Manifest) -> None:
    """TensorError naming the first tensor whose name, dtype or shape is not as expected.

    Given bytes, only the header is read.
    """
    if isinstance(state_or_buf, (bytes, bytearray, memoryview, mmap.mmap)):
        actual = tuple(info.spec for info in read_header(state_or_buf))
    else:
        actual = manifest_of(state_or_buf)
    _compare(actual, manifest)


def check_manifest_prefix(prefix: Buffer, total_size: int, manifest: Manifest) -> None:
    """``check_manifest`` on the first bytes of a blob of ``total_size`` bytes (at least its
    ``header_span``): names, dtypes and shapes are judged before any data arrives."""
    _compare((info.spec for info in read_header_prefix(prefix, total_size)), manifest)


def _compare(actual: Iterable[TensorSpec], expected: Iterable[TensorSpec]) -> None:
    have = {spec.name: spec for spec in actual}
    want = {spec.name: spec for spec in expected}
    extra = [name for name in have if name not in want]
    missing = [name for name in want if name not in have]
    if extra and missing:  # a renamed tensor: name both sides
        raise TensorError(f"tensor {extra[0]!r} is not part of the model (is it {missing[0]!r}, which is missing?)")
    for name, spec in want.items():
        got = have.get(name)
        if got is None:
            raise TensorError(f"tensor {name!r} is missing")
        if got.dtype != spec.dtype:
            raise TensorError(f"tensor {name!r} has dtype {got.dtype}, expected {spec.dtype}")
        if got.shape != spec.shape:
            raise TensorError(f"tensor {name!r} has shape {list(got.shape)}, expected {list(spec.shape)}")
    for name in have:
        if name not in want:
            raise TensorError(f"tensor {name!r} is not part of the model")


_BF16_EXPONENT: Final = 0x7F80  # all exponent bits set: infinity or NaN


def check_blob(buf: Buffer, manifest: Manifest, *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> str | None:
    """``check_manifest``, ``decode_state``'s checks and ``check_finite`` on GFT1 bytes in one pass,
    making no tensor: the header is read once, each tensor's data looked at in place (numpy views,
    a few microseconds a tensor against about ten for torch's). Raises DecodeError or TensorError
    as those do; returns the name of the first floating tensor holding NaN or infinity, or None."""
    data_start, infos = _parse(buf, max_total_bytes)
    _compare((info.spec for info in infos), manifest)
    view = _byte_view(buf)
    nonfinite: str | None = None
    for info in infos:
        if not info.nbytes:
            continue
        start = data_start + info.offset
        as_numpy = NUMPY_DTYPES.get(info.dtype)
        if info.dtype == "bool":
            _check_bool(view, info, start)
        elif nonfinite is not None:
            continue
        elif info.dtype == "bfloat16":  # read as its bits: numpy has no bfloat16
            bits = np.frombuffer(view, dtype=np.uint16, count=info.nbytes // 2, offset=start)
            if ((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any():
                nonfinite = info.name
        elif as_numpy is not None and issubclass(as_numpy, np.floating):
            values = np.frombuffer(view, dtype=as_numpy, count=info.nbytes // ITEMSIZE[info.dtype], offset=start)
            if not np.isfinite(values).all():
                nonfinite = info.name
    return nonfinite


def check_finite(state: Mapping[str, torch.Tensor]) -> None:
    """TensorError naming the first floating tensor holding NaN or infinity."""
    for name, t in state.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise TensorError(f"tensor {name!r} contains NaN or infinite values")


# ---------------------------------------------------------------------------
# safetensors export/import (for owners: any tool can load these).


def state_to_safetensors(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialise a state dict as .safetensors bytes, with ``metadata`` (text to text) in its header."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        _check_name(name)
        # clone() gives each tensor its own storage: safetensors refuses shared memory.
        tensors[name] = _wire_tensor(name, value).clone()
    data: bytes = save(tensors, metadata=dict(metadata) if metadata else None)
    return data


def safetensors_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The text metadata in a .safetensors file's JSON header ({} when it has none); DecodeError
    when the header is not there or not JSON. Reads the header only (no tensor data)."""
    import json

    view = memoryview(data)
    if len(view) < 8:
        raise DecodeError("safetensors: too short for a header")
    (size,) = struct.unpack_from("<Q", view, 0)
    if size > min(MAX_HEADER_BYTES * 4, len(view) - 8):
        raise DecodeError(f"safetensors: a header of {size} bytes does not fit the file")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
    except (ValueError, RecursionError):
        raise DecodeError("safetensors: the header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise DecodeError("safetensors: __metadata__ must map text to text")
    return dict(meta)


def state_from_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """Load .safetensors bytes; dtypes and names must pass the codec's whitelist."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not isinstance(data, (bytes, bytearray)):
        raise DecodeError("safetensors: expected bytes")
    try:
        state: dict[str, torch.Tensor] = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise DecodeError(f"safetensors: {str(exc).splitlines()[0][:100] if str(exc) else 'malformed'}") from None
    if len(state) > MAX_TENSORS:
        raise TensorError(f"{len(state)} tensors exceeds the limit of {MAX_TENSORS}")
    for name, t in state.items():
        _check_name(name)
        dtype_name(t.dtype)
    return state


__all__ = [
    "ALIGN",
    "DEFAULT_MAX_TOTAL_BYTES",
    "DTYPES",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "Manifest",
    "TensorInfo",
    "TensorSpec",
    "check_blob",
    "check_finite",
    "check_manifest",
    "check_manifest_prefix",
    "decode_state",
    "dtype_name",
    "encode_state",
    "header_span",
    "is_blob_id",
    "load_state_file",
    "manifest_of",
    "max_encoded_size",
    "read_header",
    "read_header_prefix",
    "safetensors_metadata",
    "sha256_hex",
    "state_from_safetensors",
    "state_to_safetensors",
]
