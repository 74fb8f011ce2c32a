"""The router's index of what every worker's prefix cache holds: block hash -> worker ids.

Built from the ``kv-events`` stream (jobs/kv_events.py), which each worker writes in its
publishing commit. A router replica reads the stream from its start when it starts (so a
restarted router rebuilds the index) and then, before each batch it routes, what was added
since: one non-blocking XREAD per batch (more only while a read comes back full). A worker
that is no longer alive is dropped (`keep_only`, with the liveness each batch reads anyway);
its entries, if it comes back, return with its next snapshot.

The stream is capped by count, so a replica that starts late may begin inside a worker's
changes: until that worker's next snapshot its view may lack blocks (a missed routing
chance) or keep blocks since removed (a job sent for a prefix it will prefill again). Both
cost speed, never correctness: the worker serves whatever it is sent.

Entries also carry the worker's load when it wrote them (jobs/kv_events.py `LoadReading`):
the index keeps each worker's newest (`loads`), which the router sets against the worker's
heartbeat (stages/router/stage.py), and drops it with the worker's blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import redis

from jobs.kv_blocks import leading_run
from jobs.kv_events import KvEvents, LoadReading
from jobs.protocol import ENTRY_FIELD, ProtocolError, decode
from runtime.config import BusConfig

logger = logging.getLogger(__name__)

READ_COUNT = 1000


class KvIndex:
    def __init__(self, client: redis.Redis, config: BusConfig) -> None:
        self.client = client
        self.stream = config.kv_events_stream()
        self.last_id: bytes | str = "0-0"  # from the start: a new router rebuilds the index
        self.by_worker: dict[str, set[int]] = {}  # worker id -> the block hashes it holds
        self.holders: dict[int, set[str]] = {}  # block hash -> the workers holding it
        self.loads: dict[str, LoadReading] = {}  # worker id -> the newest load it wrote

    def refresh(self) -> int:
        """Apply the entries added since the last read; how many."""
        applied = 0
        while True:
            response = self.client.xread({self.stream: self.last_id}, count=READ_COUNT)
            entries = response[0][1] if response else []
            for entry_id, fields in entries:
                self.last_id = entry_id
                try:
                    self.apply(decode((fields or {}).get(ENTRY_FIELD), KvEvents))
                except ProtocolError as exc:
                    logger.warning("%s: skipping entry %s: %s", self.stream, entry_id, exc)
            applied += len(entries)
            if len(entries) < READ_COUNT:
                return applied

    def apply(self, events: KvEvents) -> None:
        worker = events.worker_id
        if events.snapshot:
            self.forget(worker)
        held = self.by_worker.setdefault(worker, set())
        for block_hash in events.removed:
            if block_hash in held:
                held.discard(block_hash)
                self._unhold(block_hash, worker)
        for block_hash in events.stored:
            if block_hash not in held:
                held.add(block_hash)
                self.holders.setdefault(block_hash, set()).add(worker)
        load = events.load
        known = self.loads.get(worker)
        if load is not None and (known is None or load.time >= known.time):
            self.loads[worker] = load

    def expect(self, worker_id: str, hashes: Sequence[int]) -> None:
        """A job whose ids have these chained block `hashes` was just routed to `worker_id`:
        count its blocks as held there from now on, before the worker says it stores them,
        so the next jobs of a cold burst of one prefix, in the same router batch or a later
        one, follow the first. Blocks that never get stored (the job fails, the cache is
        full) stay until the worker's next snapshot."""
        held = self.by_worker.setdefault(worker_id, set())
        for block_hash in hashes:
            if block_hash not in held:
                held.add(block_hash)
                self.holders.setdefault(block_hash, set()).add(worker_id)

    def forget(self, worker_id: str) -> None:
        """Drop everything known of `worker_id` (gone, or about to send a snapshot)."""
        self.loads.pop(worker_id, None)
        for block_hash in self.by_worker.pop(worker_id, ()):
            self._unhold(block_hash, worker_id)

    def keep_only(self, worker_ids: Iterable[str]) -> None:
        """Forget every worker not in `worker_ids` (the live ones)."""
        for worker_id in (set(self.by_worker) | set(self.loads)) - set(worker_ids):
            self.forget(worker_id)

    def cached_blocks(self, hashes: Sequence[int], worker_id: str) -> int:
        """How many leading blocks of a sequence (its chained `hashes`) the worker holds."""
        return leading_run(hashes, self.by_worker.get(worker_id, ()))

    def _unhold(self, block_hash: int, worker_id: str) -> None:
        workers = self.holders.get(block_hash)
        if workers is not None:
            workers.discard(worker_id)
            if not workers:
                del self.holders[block_hash]
