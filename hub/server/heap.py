"""The serving process's garbage-collector policy.

A hub imports torch, numpy and aiohttp before it serves: several hundred thousand objects that
live as long as the process. CPython's cyclic collector walks every tracked object of a
generation it collects, so each full collection re-walks that start-up heap, and with the default
thresholds (700, 10, 10) a busy hub collects often: `perf` on a hub serving 1,000 nodes put
`gc_collect_main` and its visitors at about 14 % of the process's CPU.

``settle_heap`` is called once the hub is set up and before it takes requests:

* ``gc.freeze()`` moves everything alive then into the permanent generation, which no collection
  walks again (what long-lived CPython servers do after start-up);
* the first generation is collected every ``GEN0`` allocations rather than every 700: a request
  makes a few hundred short-lived objects, which reference counting frees without the collector,
  so a collection every few requests mostly finds nothing. Cycles are still collected, in bigger,
  rarer passes.

Measured in bench/hub_load.py (docs/performance.md, "hub load").
"""

from __future__ import annotations

import gc

#: allocations between first-generation collections (CPython's default is 700)
GEN0 = 20_000
#: first-generation collections per second-generation one, and second per full (defaults 10, 10)
GEN1 = 50
GEN2 = 100


def settle_heap() -> None:
    """Collect once, freeze what start-up left alive, and collect young objects less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0, GEN1, GEN2)


__all__ = ["GEN0", "GEN1", "GEN2", "settle_heap"]
