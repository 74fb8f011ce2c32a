"""Which waiting requests to admit first."""

from __future__ import annotations

from collections.abc import Callable

from gpu_worker.scheduling.req import Req

# Longest-prefix-match sorting costs a tree walk per waiting request; past this many the
# sort costs more than it saves, so the policy falls back to arrival order.
LPM_MAX_QUEUE = 128


def order_waiting(
    waiting: list[Req], policy: str, cached_prefix_len: Callable[[Req], int]
) -> list[Req]:
    """Lower `priority` classes first. Within a class, requests of several tenants go in
    fair-share order (their start tags, scheduling/fair_share.py); those of one tenant as
    the policy says: fcfs keeps arrival order (retracted requests sit at the front) and lpm
    puts the requests with the longest cached prefix first, so the cache is hit before it
    is evicted."""
    if len(waiting) > 1 and any(req.tenant != waiting[0].tenant for req in waiting):
        return sorted(waiting, key=lambda req: (req.priority, req.fair_tag))
    if policy == "lpm" and 1 < len(waiting) <= LPM_MAX_QUEUE:
        ordered = sorted(waiting, key=lambda req: -cached_prefix_len(req))
    else:
        ordered = list(waiting)
    if any(req.priority != ordered[0].priority for req in ordered):
        ordered.sort(key=lambda req: req.priority)  # stable: keeps the order above
    return ordered


def shares_prefix_with_batch(
    req: Req, cached_len: int, admitted: list[Req], min_shared: int
) -> bool:
    """Whether `req` shares at least `min_shared` uncached tokens with a request already in
    this batch. Such a request waits one step: the batch will put that prefix in the cache,
    and computing it twice in one forward would waste the work."""
    if req.pooling is not None:
        return False  # an embedding takes nothing from the cache (scheduling/pooling.py)
    end = cached_len + min_shared
    ids = req.all_ids
    if len(ids) <= end:
        return False
    head = ids[:end]
    return any(
        len(other.origin_input_ids) > end and other.origin_input_ids[:end] == head
        for other in admitted
    )
