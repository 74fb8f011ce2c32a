"""The garbage collector's settings for a long-running stage process.

A stage makes many short-lived objects per message (a reply's dicts, a chunk's bytes) and
holds a large heap that never changes after start-up (modules, the app, the tokenizer).
CPython's defaults collect the youngest generation every 700 allocations net of frees, and
now and then walk the whole heap: in the ingress under load (`bench_bus_load.py --workers 2
--clients 128`) that was 6-7% of its CPU, ~280 collections in 30 s. After `settle_heap` the
start-up heap is never walked again (`gc.freeze`), and the youngest generation is collected
every `YOUNG_THRESHOLD` allocations: ~30 collections of ~3 ms each in the same run, 2-3% of
its CPU. A pause of a few ms is well inside a stream's publish interval (50 ms).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 5000
OLDER_THRESHOLDS = (10, 10)  # collections of the generation below between two of the next


def settle_heap() -> None:
    """Freeze what exists now, and collect less often: call once, when start-up is done."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
