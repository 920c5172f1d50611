"""Versions that both sides of the wire compare."""

from importlib import metadata

from .errors import VersionError

#: 2: the compute class in Hello, precision in TrainConfig and Benchmark; 3: a StateRequest may
#: name every checkpoint of a commitment (up to MAX_CHECKPOINTS; it was 8); 4: a RelayHeader may
#: carry a stage's sketch, and a StageReport its update_s and unit_overhead_s (a node of 3 would
#: refuse a neighbour's sketched header, and a hub of 3 the new report fields)
PROTOCOL_VERSION = 4

try:
    SOFTWARE_VERSION: str = metadata.version("gpuflex")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    SOFTWARE_VERSION = "0.0.0+source"


def check_protocol_version(peer_version: int, *, peer: str = "peer") -> None:
    """VersionError naming both versions unless ``peer_version`` is ours.

    The hub calls this with ``Hello.protocol_version`` (-> 409 version_mismatch).
    """
    if isinstance(peer_version, bool) or peer_version != PROTOCOL_VERSION:
        raise VersionError(
            f"{peer} speaks protocol version {peer_version}, this software speaks "
            f"{PROTOCOL_VERSION}; upgrade the older side"
        )
