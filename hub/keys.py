"""The hub's Ed25519 identity: created once (0600), then loaded on every start."""

from __future__ import annotations

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
