"""A request's speculative-decoding state, which the request carries (Req.draft) and the
drafter updates: kept apart from the drafter so that a request needs nothing of the drafter."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.speculative.ngram import NgramIndex

# A request's acceptance rate before it has verified anything.
PRIOR_ACCEPTANCE = 0.5


@dataclass
class DraftState:
    """One request's drafting: its n-gram index, adaptive length, backoff and figures."""

    index: NgramIndex = field(default_factory=NgramIndex)  # the n-gram proposer's
    length: int = 0  # tokens to draft next; 0 until the first proposal sets it
    acceptance: float = PRIOR_ACCEPTANCE  # moving average of accepted / drafted
    misses: int = 0  # verify steps in a row that accepted no draft
    pause: int = 0  # steps left without drafting
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
