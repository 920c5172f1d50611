"""The hub's Ed25519 identity: created once (0600), then loaded on every start; and the
secrets derived from it."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from gpuflex.protocol.signing import SigningKey


def load_or_create_hub_key(path: Path) -> tuple[SigningKey, bool]:
    """Returns (key, created)."""
    if path.exists():
        return SigningKey.load(path), False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()
    key.save(path)
    return key, True


def audit_secret(key: SigningKey) -> bytes:
    """The key of the referee's spot-check draws (hub/domain/rounds.py ``RoundEngine.spot_draw``): an
    HMAC of a fixed label under the hub's private key. Stable across restarts, so a shard's
    draw is the same after a crash; known to nobody without the hub's key file."""
    return hmac.new(key.private_bytes(), b"gpuflex/audit-draws/v1", hashlib.sha256).digest()
