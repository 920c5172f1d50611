"""How much training one assignment is: its optimizer steps and the samples they process.

A job trains ``local_epochs`` passes over each shard, or, when ``local_steps`` is set, exactly
that many optimizer steps (DiLoCo's inner steps: a round's work no longer grows with the
shard). Steps walk the shard's per-epoch permutations in order (node/trainer.py), so step ``s``
is batch ``s mod ceil(n / batch)`` of epoch ``s div ceil(n / batch)`` either way; the hub's
deadlines, throughput, heartbeat bounds and the referee's commitment grid all count work with
these two functions. Pure functions, no I/O.
"""

from __future__ import annotations

import math


def assignment_steps(samples: int, batch_size: int, local_epochs: int, local_steps: int = 0) -> int:
    """Optimizer steps of one assignment over ``samples`` (0 when it has no samples)."""
    if samples <= 0:
        return 0
    if local_steps > 0:
        return local_steps
    return math.ceil(samples / max(batch_size, 1)) * max(local_epochs, 1)


def samples_processed(samples: int, batch_size: int, local_epochs: int, local_steps: int = 0) -> int:
    """Samples those steps run through (a whole epoch's samples per full epoch, then the
    batches of the last, partial one)."""
    if samples <= 0:
        return 0
    if local_steps <= 0:
        return samples * max(local_epochs, 1)
    per_epoch = math.ceil(samples / max(batch_size, 1))
    full, rest = divmod(local_steps, per_epoch)
    return full * samples + min(rest * max(batch_size, 1), samples)


__all__ = ["assignment_steps", "samples_processed"]
