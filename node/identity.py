"""The node's own key and the hub key it trusts.

* ``node.key``: Ed25519, created 0600 on first run; the node id is its fingerprint.
* ``hub.pin``: the hub's public key (hex) and fingerprint, written on first contact
  (trust on first use) unless ``--hub-key`` names the fingerprint to expect. From then on
  a hub presenting any other key is refused, loudly, until the volunteer decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpuflex.protocol.errors import KeyFileError
from gpuflex.protocol.signing import SigningKey, fingerprint

from .errors import HubKeyMismatch, IdentityError
from .files import write_private_file

__all__ = ["KEY_FILE", "PIN_FILE", "HubPin", "check_hub_key", "load_key", "load_or_create_key", "write_private_file"]

KEY_FILE = "node.key"
PIN_FILE = "hub.pin"


def load_key(data_dir: Path) -> SigningKey | None:
    """DIR/node.key, or None when there is none yet (nothing is created)."""
    path = data_dir / KEY_FILE
    if not path.exists():
        return None
    try:
        return SigningKey.load(path)
    except KeyFileError as exc:
        raise IdentityError(str(exc)) from exc


def load_or_create_key(data_dir: Path) -> SigningKey:
    """Load DIR/node.key, or create it (0600) on first run."""
    path = data_dir / KEY_FILE
    existing = load_key(data_dir)
    if existing is not None:
        return existing
    key = SigningKey.generate()
    try:
        key.save(path)
    except (OSError, KeyFileError) as exc:
        raise IdentityError(f"cannot write the node key to {path}: {exc}") from exc
    return key


@dataclass(frozen=True)
class HubPin:
    public_key: bytes
    fingerprint: str


def _mismatch(expected: str, got: str, url: str, pin_path: Path | None) -> HubKeyMismatch:
    where = f" (pinned in {pin_path})" if pin_path else " (given with --hub-key)"
    advice = (
        f"If the hub operator really replaced its key, confirm the new fingerprint with them, "
        f"then delete {pin_path} or pass --hub-key {got}."
        if pin_path
        else "Check the fingerprint with the hub operator."
    )
    return HubKeyMismatch(
        f"REFUSING TO WORK: the hub at {url} presents key {got}, but this node trusts {expected}"
        f"{where}. Someone may be impersonating the hub. {advice}"
    )


def check_hub_key(
    data_dir: Path, url: str, public_key: bytes, claimed_fingerprint: str, expected: str | None
) -> HubPin:
    """Decide whether to trust the key the hub at ``url`` presents; pin it on first use.

    ``expected`` is ``--hub-key`` (a fingerprint) or None for trust on first use.
    Raises HubKeyMismatch with a loud, actionable message when trust is broken.
    """
    if len(public_key) != 32:
        raise HubKeyMismatch(f"the hub at {url} sent a public key of {len(public_key)} bytes, not 32")
    actual = fingerprint(public_key)
    if claimed_fingerprint != actual:
        raise HubKeyMismatch(
            f"REFUSING TO WORK: the hub at {url} claims fingerprint {claimed_fingerprint} "
            f"but its key's fingerprint is {actual}"
        )
    pin_path = data_dir / PIN_FILE
    if expected is not None and expected.strip().lower() != actual:
        raise _mismatch(expected.strip().lower(), actual, url, None)
    if pin_path.exists():
        try:
            pinned = json.loads(pin_path.read_text(encoding="utf-8"))
            pinned_fpr = str(pinned["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HubKeyMismatch(
                f"cannot read the pinned hub key {pin_path} ({exc}); delete it to pin again"
            ) from exc
        if pinned_fpr != actual:
            if expected is not None:  # the volunteer explicitly names the new key: re-pin
                pass
            else:
                raise _mismatch(pinned_fpr, actual, url, pin_path)
        elif str(pinned.get("public_key", "")) == public_key.hex():
            return HubPin(public_key, actual)
    write_private_file(
        pin_path,
        json.dumps({"fingerprint": actual, "public_key": public_key.hex(), "url": url}) + "\n",
    )
    return HubPin(public_key, actual)
