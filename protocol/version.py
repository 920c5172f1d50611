"""Versions that both sides of the wire compare."""

from importlib import metadata

PROTOCOL_VERSION = 1

try:
    SOFTWARE_VERSION: str = metadata.version("gpuflex")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    SOFTWARE_VERSION = "0.0.0+source"
