"""Which waiting requests to admit first.

The default, spf (shortest prefill first, aged), admits a burst's shortest prompts first:
their first tokens come after fewer prefill steps, so the median time to first token
falls (mixed-64's burst: its median request's prefill done after 3-4 of 10 chunked steps
instead of 5), while the burst's last first token, and the work, are the same. A request's
place is its arrival plus SPF_PATIENCE times the time its own prefill takes here
(`PrefillCost`): it yields only to requests that arrive within that, so no stream of short
prompts starves a long one. A worker's job arrived when it entered the system (its
`created`, gpu_worker/job_admission.py), not when the worker read it after a long step.
"""

from __future__ import annotations

from collections.abc import Callable

from gpu_worker.scheduling.req import Req

# Longest-prefix-match sorting costs a tree walk per waiting request; past this many the
# sort costs more than it saves, so the policy falls back to arrival order.
LPM_MAX_QUEUE = 128
# What a prefill token is taken to cost before the engine has timed one: a 2-core CPU's
# order (0.2-0.6 ms measured), so a first burst already goes shortest first.
DEFAULT_PREFILL_S_PER_TOKEN = 5e-4
# spf lets a request be passed by later, shorter ones for up to this many times its own
# prefill time. A burst reaches the worker spread over about as long as a prefill takes
# (its requests pass the ingress and tokenizer one by one), so at 1 arrival order would
# still decide much of a burst's order.
SPF_PATIENCE = 4.0
# spf sorts only the queue's oldest this many: a step admits far fewer, and a queue of
# thousands (a batch's lines) is not sorted again at every step.
SPF_WINDOW = 512


class PrefillCost:
    """Seconds a prefill token takes on this engine, from its own extend steps: decayed sums
    of seconds and tokens, so a few-token extend's fixed cost weighs as little as its
    tokens, and a changed load shows within a few steps."""

    DECAY = 0.9

    def __init__(self) -> None:
        self._seconds = 0.0
        self._tokens = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        self._seconds = self._seconds * self.DECAY + seconds
        self._tokens = self._tokens * self.DECAY + tokens

    @property
    def per_token(self) -> float:
        return self._seconds / self._tokens if self._tokens else DEFAULT_PREFILL_S_PER_TOKEN


def order_waiting(
    waiting: list[Req],
    policy: str,
    cached_prefix_len: Callable[[Req], int],
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
) -> list[Req]:
    """Lower `priority` classes first. Within a class, requests of several tenants go in
    fair-share order (their start tags, scheduling/fair_share.py); those of one tenant as
    the policy says: spf by arrival plus SPF_PATIENCE times the request's own prefill
    time (its tokens at `prefill_s_per_token`: the module docstring), fcfs in arrival
    order (retracted requests sit at the front), and lpm the requests with the longest
    cached prefix first, so the cache is hit before it is evicted."""
    if len(waiting) > 1 and any(req.tenant != waiting[0].tenant for req in waiting):
        return sorted(waiting, key=lambda req: (req.priority, req.fair_tag))
    if policy == "spf" and len(waiting) > 1:
        # A retracted request arrived long ago: its early place keeps it at the front.
        patience_per_token = SPF_PATIENCE * prefill_s_per_token
        head = sorted(
            waiting[:SPF_WINDOW], key=lambda req: req.arrived + req.num_tokens * patience_per_token
        )
        ordered = head + waiting[SPF_WINDOW:]
    elif policy == "lpm" and 1 < len(waiting) <= LPM_MAX_QUEUE:
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
