"""Non-IID partitions of a labelled dataset, as flwr-datasets' DirichletPartitioner makes them.

For each label, the share of its samples each of ``n`` partitions gets is drawn from
Dirichlet(alpha, ..., alpha): small alpha gives each partition a few dominant labels, large
alpha approaches an IID split. Draws repeat (a new seed each time) until every partition holds
at least ``min_size`` samples, as flwr-datasets does. Deterministic for a seed.
"""

from __future__ import annotations

import numpy as np


def dirichlet_split(y: np.ndarray, n: int, alpha: float, *, seed: int = 0, min_size: int = 10,
                    max_tries: int = 1000) -> list[np.ndarray]:
    """Index arrays (sorted) of ``n`` partitions of the samples labelled ``y``."""
    if n < 1 or alpha <= 0:
        raise ValueError("dirichlet_split needs n >= 1 and alpha > 0")
    labels = np.unique(y)
    for attempt in range(max_tries):
        rng = np.random.default_rng([seed, attempt])
        parts: list[list[int]] = [[] for _ in range(n)]
        for label in labels:
            idx = np.flatnonzero(y == label)
            idx = idx[rng.permutation(idx.size)]
            shares = rng.dirichlet(np.full(n, alpha))
            cuts = (np.cumsum(shares) * idx.size).astype(int)[:-1]
            for i, piece in enumerate(np.split(idx, cuts)):
                parts[i].extend(piece.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"no Dirichlet({alpha}) split of {len(y)} samples into {n} gives each {min_size}")
