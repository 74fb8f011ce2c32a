"""Keep freed memory in glibc's heap on CPU, so large tensors do not page-fault every step.

glibc serves allocations above its mmap threshold with fresh mmap()s and hands freed heap
tops back to the OS past its trim threshold. A forward allocates and frees tensors of tens
of megabytes per layer, so by default each one comes back as new pages and the first op to
touch it pays the page faults: a 4096-token MLP block took 40 ms instead of 27 here. CPU
servers usually preload tcmalloc or jemalloc for this; raising the two thresholds gets the
same effect with the system allocator. The cost: memory freed after a peak is kept by the
process instead of being returned to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems (larger values are refused).
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**30

_applied = False


def keep_freed_memory_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where not glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    _applied = ok
    if not ok:
        logger.warning("mallopt refused the heap thresholds; CPU forwards may page-fault more")
    return ok
