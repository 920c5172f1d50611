"""How the read model writes a number for a reader: in a flag's headline, its scores' rules, the
console's chart labels."""

from __future__ import annotations


def short_number(v: float) -> str:
    """Short human number for labels: 0.0123, 1.5e-05, 1200."""
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.2g}"
    return f"{v:.4g}"
