"""Which live worker a job goes to: the prefix its cache would reuse against its load.

With ``router_policy = "kv"`` each live worker gets a score for a job:

    expected_cached = B x (leading blocks of the job's ids the worker holds)   (kv_index.py)
    load_tokens     = queued jobs x kv_job_load_tokens                           (stage.py)
    score           = kv_cache_weight x expected_cached - kv_load_weight x load_tokens

and the highest score wins; among equal scores the existing load order decides (fewest
queued, then most free KV, then fewest routed so far), so cold prefixes and ties spread load
as load-only routing does.

A job is scored the same whether the jobs before it came in its router batch or in earlier
ones: each routed job counts at once as queued on its worker (one more job, as the routed
count says across batches) and its blocks as held there (`KvIndex.expect`). So in a cold
burst the first job of a prefix goes by load and the later ones follow it, while cold jobs
of other prefixes see that worker one job busier and go elsewhere. (The load term counts
jobs, not the prompt tokens a batch sent a worker: a burst's first job would weigh its whole
prompt, prefix included, against the prefix the next jobs would reuse behind it, and send
each of them to a cold worker to prefill the prefix again.)

A hot prefix must not pile every request onto its holder: when the winner has more than
``kv_balance_jobs`` jobs queued above the least loaded worker, the least loaded takes the
job, prefills the prefix once and holds it too.

Each choice says why (`Choice.reason`): ``prefix`` (the winner holds part of the prompt),
``load`` (no worker holds any of it, or the load outweighed what one held), ``balance``
(the hot-prefix rule), or ``policy`` (load-only routing); the router counts decisions by
reason and the tokens it expected each worker to find cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.config import BusConfig


class Candidate(Protocol):  # stages/router/stage.py WorkerLoad
    worker_id: str
    queued: int
    free_kv_tokens: int
    routed: int  # jobs routed to it so far (every router replica's, `<p>:routed`)


class BlockLookup(Protocol):  # stages/router/kv_index.py KvIndex
    def cached_blocks(self, hashes: Sequence[int], worker_id: str) -> int: ...


@dataclass(frozen=True)
class Choice:
    worker: Candidate
    reason: str  # "prefix", "load", "balance" or "policy"
    expected_cached: int  # prompt tokens the worker is expected to find in its cache


def load_order(worker: Candidate) -> tuple[int, int, int]:
    """Least queued first; of equals, the one with the most free KV; of those, the one routed
    the fewest jobs so far. The last spreads the cold requests of an idle fleet, where every
    worker reads as empty (its load as fresh as its last finish) with the same free KV (its
    cache counts as free): without it they would all go to the first worker by id."""
    return (worker.queued, -worker.free_kv_tokens, worker.routed)


def choose(
    workers: Sequence[Candidate], hashes: Sequence[int], prompt_tokens: int,
    index: BlockLookup | None, config: BusConfig,
) -> Choice:  # fmt: skip
    """The worker for a job whose ids have the chained block `hashes` (jobs/kv_blocks.py);
    `index` None routes by load alone."""
    least = min(workers, key=load_order)
    if index is None:
        return Choice(least, "policy", 0)
    block = config.kv_block_tokens
    # A worker computes at least the prompt's last token, whatever it holds.
    cached = {w.worker_id: min(block * index.cached_blocks(hashes, w.worker_id),
                               max(0, prompt_tokens - 1)) for w in workers}  # fmt: skip

    def score(worker: Candidate) -> float:
        load = worker.queued * config.kv_job_load_tokens
        return config.kv_cache_weight * cached[worker.worker_id] - config.kv_load_weight * load

    best = min(workers, key=lambda w: (-score(w), *load_order(w)))
    if best is not least and best.queued - least.queued > config.kv_balance_jobs:
        return Choice(least, "balance", cached[least.worker_id])
    expected = cached[best.worker_id]
    return Choice(best, "prefix" if expected > 0 else "load", expected)
