"""RequestKV: moves KV slots between requests, the page allocator and the prefix cache.

A request's row in ReqToTokenPool maps its positions to KV slots. Positions below
`cached_len` point into the prefix cache (locked by the request); positions from
`cached_len` to `kv_len` are slots the request owns. Every transfer keeps the pages
accounted for: free + held by the cache + held by requests == all pages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.memory.allocator import PagedTokenAllocator
from gpu_worker.memory.radix_cache import RadixCache, cache_request_prefix
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.scheduling.req import Req


class RequestKV:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: PagedTokenAllocator,
        prefix_cache: RadixCache | None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.page_size = allocator.page_size

    def available_tokens(self) -> int:
        """Tokens that can be allocated now, counting what eviction would free."""
        evictable = self.prefix_cache.evictable_size() if self.prefix_cache else 0
        return self.allocator.available_size() + evictable

    def can_attach(self) -> bool:
        return self.req_to_token_pool.available_size() > 0

    def cached_prefix_len(self, req: Req) -> int:
        """How many tokens a fresh admission of `req` would take from the prefix cache."""
        if self.prefix_cache is None:
            return 0
        return len(self.prefix_cache.match_prefix(self._matchable_ids(req)).slots)

    def attach(self, req: Req) -> bool:
        """Give `req` a row and, when it has no KV yet, the longest cached prefix of its tokens."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        if self.prefix_cache is not None and req.kv_len == 0:
            match = self.prefix_cache.match_prefix(self._matchable_ids(req))
            self.prefix_cache.inc_lock_ref(match.last_node)
            req.last_node = match.last_node
            req.kv_len = req.cached_len = len(match.slots)
            self.req_to_token_pool.write(row, 0, match.slots)
        if req.prompt_cache_hit is None:
            req.prompt_cache_hit = min(req.cached_len, len(req.origin_input_ids))
        return True

    def alloc_extend(self, req: Req, num_new: int) -> torch.Tensor | None:
        """Slots for positions kv_len .. kv_len + num_new - 1, written into the request's row."""
        prefix = req.kv_len
        slots = self._with_eviction(
            lambda: self.allocator.alloc_extend([prefix], [num_new], [self._last_slot(req)]),
            num_new + self.page_size,
        )
        if slots is not None:
            self.req_to_token_pool.write(req.req_pool_idx, prefix, slots)
        return slots

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot per request for position kv_len, written into each row."""
        seq_lens = [req.kv_len for req in reqs]
        last_slots = [self._last_slot(req) for req in reqs]
        slots = self._with_eviction(
            lambda: self.allocator.alloc_decode(seq_lens, last_slots),
            len(reqs) * self.page_size,
        )
        if slots is not None:
            rows = torch.tensor([req.req_pool_idx for req in reqs], device=slots.device)
            positions = torch.tensor(seq_lens, device=slots.device)
            self.req_to_token_pool.write_positions(rows, positions, slots)
        return slots

    def alloc_extend_all(self, reqs: list, num_new: list[int]) -> torch.Tensor | None:
        """`alloc_extend` for each request in turn, all or none: on a shortfall, what was
        allocated for the earlier ones goes back."""
        locs: list[torch.Tensor] = []
        for req, n in zip(reqs, num_new, strict=True):
            slots = self.alloc_extend(req, n)
            if slots is None:
                for done, done_n in zip(reqs, num_new[: len(locs)], strict=False):
                    self.free_beyond(done, done.kv_len + done_n)
                return None
            locs.append(slots)
        return torch.cat(locs)

    def free_beyond(self, req: Req, allocated_end: int) -> None:
        """Give back the slots allocated for positions kv_len .. allocated_end - 1 (drafts
        that were rejected): the whole pages past kv_len's page. A partly used last page
        stays the request's, and later positions take the same slots in it."""
        first_free = -(-req.kv_len // self.page_size) * self.page_size
        if allocated_end > first_free:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            self.allocator.free(row[first_free:allocated_end])

    def cache_prefix(self, req: Req) -> None:
        """Hand the request's computed whole pages to the prefix cache (it keeps a lock)."""
        if self.prefix_cache is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        cached_slots, node = cache_request_prefix(
            self.prefix_cache,
            self.allocator,
            req.all_ids[: req.kv_len],
            row[: req.kv_len],
            req.cached_len,
            req.last_node,
        )
        self.req_to_token_pool.write(req.req_pool_idx, 0, cached_slots)
        req.cached_len = len(cached_slots)
        req.last_node = node

    def release(self, req: Req) -> None:
        """Free everything the request holds; whole computed pages stay in the prefix cache."""
        if req.req_pool_idx is None:
            return
        self.cache_prefix(req)
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        if req.kv_len > req.cached_len:
            self.allocator.free(row[req.cached_len : req.kv_len])
        if self.prefix_cache is not None and req.last_node is not None:
            self.prefix_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.cached_len = 0

    def _matchable_ids(self, req: Req) -> list[int]:
        # At least one token must be computed: its logits give the next token. Positions
        # whose logits the prompt logprobs still need are computed too, and all an embedding
        # pools: a cached position has KV but no hidden state (scheduling/pooling.py).
        if req.pooling is not None:
            return []
        return req.all_ids[: min(req.num_tokens - 1, req.prompt_logits_from)]

    def _last_slot(self, req: Req) -> int:
        if req.kv_len % self.page_size == 0:
            return 0  # the next position opens a new page; the allocator ignores this
        return int(self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len - 1])

    def _with_eviction(
        self, allocate: Callable[[], torch.Tensor | None], tokens_needed: int
    ) -> torch.Tensor | None:
        slots = allocate()
        if slots is None and self.prefix_cache is not None:
            shortfall = tokens_needed - self.allocator.available_size()
            if self.prefix_cache.evict(max(shortfall, self.page_size)) > 0:
                slots = allocate()
        return slots
