"""Which blocks a worker's prefix cache holds, and what changed since it last said so: the
worker's side of KV-aware routing (jobs/kv_events.py; the router's is stages/router/kv_index.py).

`CachedBlocks` listens to the RadixCache (gpu_worker/memory/radix_cache.py). The tree holds
each token prefix at most once, so a block (named by the chained hash of the prefix it ends,
jobs/kv_blocks.py) is held exactly while the tree holds that prefix: an insert stores the
blocks ending past what the tree already held of its key, an eviction removes the blocks
ending inside the evicted node. The work is the insert's or the eviction's own (hashing the
path's tokens), never a walk of the cache per step.

Each publish takes what changed (`take`) as one `KvEvents` entry, or nothing when nothing did;
a snapshot of every held block replaces it when the worker starts (an empty one: a new life
holds nothing), when the tree was cleared, after a commit that was fenced off (its entry was
not written), and every ``kv_snapshot_interval_s`` while the cache changes.
"""

from __future__ import annotations

import time

from jobs.kv_blocks import block_hashes
from jobs.kv_events import KvEvents


class CachedBlocks:
    def __init__(self, worker_id: str, block_tokens: int, snapshot_interval_s: float) -> None:
        self.worker_id = worker_id
        self.block_tokens = block_tokens
        self.snapshot_interval_s = snapshot_interval_s
        self.held: set[int] = set()
        self._stored: dict[int, None] = {}  # since the last entry, in order
        self._removed: dict[int, None] = {}
        self._snapshot_due = True  # the first entry tells readers this life holds nothing
        self._last_snapshot = time.monotonic()

    # ---- the cache's listener (gpu_worker/memory/radix_cache.py CacheListener) ------------

    def inserted(self, key: list[int], already: int) -> None:
        for block_hash in block_hashes(key, self.block_tokens, start=already // self.block_tokens):
            if block_hash not in self.held:
                self.held.add(block_hash)
                self._note(block_hash, self._stored, self._removed)

    def evicted(self, path: list[int], start: int) -> None:
        for block_hash in block_hashes(path, self.block_tokens, start=start // self.block_tokens):
            if block_hash in self.held:
                self.held.discard(block_hash)
                self._note(block_hash, self._removed, self._stored)

    def cleared(self) -> None:
        self.held.clear()
        self.resend()

    # ---- what the next publish carries ----------------------------------------------------

    def resend(self) -> None:
        """The next entry is a snapshot (readers may have missed what came before)."""
        self._stored.clear()
        self._removed.clear()
        self._snapshot_due = True

    def take(self) -> KvEvents | None:
        """The entry for the next publish: the changes since the last one, a snapshot, or
        None when nothing changed."""
        changed = bool(self._stored or self._removed)
        now = time.monotonic()
        if self._snapshot_due or (changed and now - self._last_snapshot
                                  >= self.snapshot_interval_s):  # fmt: skip
            self._snapshot_due = False
            self._last_snapshot = now
            self._stored.clear()
            self._removed.clear()
            return KvEvents(self.worker_id, sorted(self.held), [], snapshot=True)
        if not changed:
            return None
        events = KvEvents(self.worker_id, list(self._stored), list(self._removed))
        self._stored.clear()
        self._removed.clear()
        return events

    @staticmethod
    def _note(block_hash: int, into: dict[int, None], undo: dict[int, None]) -> None:
        # Stored then removed within one publish (or the reverse) tells readers nothing.
        if block_hash in undo:
            del undo[block_hash]
        else:
            into[block_hash] = None


def watch_prefix_cache(scheduler: object, worker_id: str, block_tokens: int,
                       snapshot_interval_s: float) -> CachedBlocks | None:  # fmt: skip
    """A `CachedBlocks` listening to the scheduler's prefix cache; None for an engine without
    one (the synthetic engine, or --disable-radix-cache): such a worker publishes no events."""
    kv = getattr(scheduler, "kv", None)
    cache = getattr(kv, "prefix_cache", None)
    if cache is None:
        return None
    # A worker made on an engine that already served (tests do) replaces the listener; the
    # blocks cached before it go unreported (their eviction too: `evicted` skips them).
    blocks = CachedBlocks(worker_id, block_tokens, snapshot_interval_s)
    cache.listener = blocks
    return blocks
