"""The benchmark job as a Flower app (used by bench/vs_flower.py)."""
