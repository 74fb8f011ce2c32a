"""PagedTokenAllocator: hands out KV slots a page at a time.

A slot is `page * page_size + offset`. Pages 1..num_pages are usable; page 0 is the padding
page of TokenToKVPool and is never handed out. A request fills its pages in position order,
so position p of a request lives at offset p % page_size of some page it owns; this is what
lets the prefix cache share whole pages and lets a request continue in its last page.

Free pages are a queue of device tensors, runs of pages (allocation is slicing, no host
sync), handed out in the order they became free: a free appends its pages as one run, so
it costs what it frees, not a copy of every free page (a pool of millions of pages, as a
small model's is, made each free ~20 ms). The per-page state tensor makes a double free
detectable with one vectorized check.
"""

from __future__ import annotations

import collections

import torch

_ALLOCATED = 0
_FREE = 1
_PADDING = 2


class PagedTokenAllocator:
    """Hands out KV slots a page at a time; slot = page * page_size + offset. Page 0 is the
    padding page."""

    def __init__(self, size: int, page_size: int, device: torch.device | str) -> None:
        if page_size < 1 or size < page_size or size % page_size:
            raise ValueError(f"size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()

    def clear(self) -> None:
        """Every usable page free again (the prefix cache must be reset alongside)."""
        # Runs of free pages; the first one's first pages are handed out next.
        self._free_runs = collections.deque(
            [torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)]
        )
        self._num_free = self.num_pages
        self.page_state = torch.full(
            (self.num_pages + 1,), _FREE, dtype=torch.int8, device=self.device
        )
        self.page_state[0] = _PADDING

    @property
    def free_pages(self) -> torch.Tensor:
        """Every free page, in the order they would be handed out (for inspection)."""
        if not self._free_runs:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(list(self._free_runs))

    def num_free_pages(self) -> int:
        return self._num_free

    def available_size(self) -> int:
        """Free tokens = free pages * page_size."""
        return self.num_free_pages() * self.page_size

    def num_pages_needed(self, prefix_len: int, extend_len: int) -> int:
        """Fresh pages for positions prefix_len .. prefix_len + extend_len - 1 (for admission)."""
        room_in_last_page = -prefix_len % self.page_size
        fresh_tokens = max(extend_len - room_in_last_page, 0)
        return -(-fresh_tokens // self.page_size)

    def alloc_extend(
        self, prefix_lens: list[int], extend_lens: list[int], last_slots: list[int]
    ) -> torch.Tensor | None:
        """KV slots for positions prefix_len .. prefix_len + extend_len - 1 of each request,
        concatenated in request order.

        Positions in a request's partly filled last page (prefix_len % page_size != 0) continue
        from last_slots[i] + 1, the slot of position prefix_len - 1 plus one; the rest get fresh
        pages. All-or-nothing: None, and nothing allocated, when free pages do not suffice.
        """
        ps = self.page_size
        pages_per_req = []
        for prefix_len, extend_len, last_slot in zip(
            prefix_lens, extend_lens, last_slots, strict=True
        ):
            if extend_len and prefix_len % ps:
                self._check_continues(prefix_len, last_slot)
            pages_per_req.append(self.num_pages_needed(prefix_len, extend_len))
        pages = self._take_pages(sum(pages_per_req))
        if pages is None:
            return None
        # All fresh slots in request order; each request takes a prefix of its own pages' run.
        fresh_slots = (pages[:, None] * ps + self._offsets).reshape(-1)
        pieces = []
        page_cursor = 0
        for prefix_len, extend_len, last_slot, num_pages in zip(
            prefix_lens, extend_lens, last_slots, pages_per_req, strict=True
        ):
            in_last_page = min(extend_len, -prefix_len % ps)
            if in_last_page:
                pieces.append(
                    torch.arange(
                        last_slot + 1,
                        last_slot + 1 + in_last_page,
                        dtype=torch.int64,
                        device=self.device,
                    )
                )
            fresh = extend_len - in_last_page
            if fresh:
                start = page_cursor * ps
                pieces.append(fresh_slots[start : start + fresh])
            page_cursor += num_pages
        if not pieces:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(pieces)

    def alloc_decode(self, seq_lens: list[int], last_slots: list[int]) -> torch.Tensor | None:
        """One slot per request for position seq_lens[i]: last_slots[i] + 1, or the first slot
        of a fresh page where seq_lens[i] % page_size == 0. All-or-nothing like alloc_extend."""
        ps = self.page_size
        opens_page = [i for i, seq_len in enumerate(seq_lens) if seq_len % ps == 0]
        for seq_len, last_slot in zip(seq_lens, last_slots, strict=True):
            if seq_len % ps:
                self._check_continues(seq_len, last_slot)
        pages = self._take_pages(len(opens_page))
        if pages is None:
            return None
        if len(opens_page) == len(seq_lens):
            # Every request opens a page (always so with page_size 1): no host-built tensor.
            return pages * ps
        slots = torch.tensor(last_slots, dtype=torch.int64).to(self.device) + 1
        if opens_page:
            index = torch.tensor(opens_page, dtype=torch.int64).to(self.device)
            slots[index] = pages * ps
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that contain these slots.

        Callers free only whole pages they own, or a request's partly filled last page.
        Raises on a page that is not allocated (a double free, or the padding page).
        """
        if slots.numel() == 0:
            return
        pages = torch.unique(slots.reshape(-1) // self.page_size)  # host sync (output size)
        if bool((self.page_state[pages] != _ALLOCATED).any()):  # host sync: the bug detector
            bad = pages[self.page_state[pages] != _ALLOCATED].tolist()
            raise RuntimeError(f"freeing pages that are not allocated (double free?): {bad[:8]}")
        self.page_state[pages] = _FREE
        self._free_runs.append(pages)
        self._num_free += len(pages)

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self._num_free:
            return None
        if num_pages == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        taken: list[torch.Tensor] = []
        needed = num_pages
        while needed:
            run = self._free_runs[0]
            if len(run) <= needed:
                taken.append(self._free_runs.popleft())
                needed -= len(run)
            else:
                taken.append(run[:needed])
                self._free_runs[0] = run[needed:]
                needed = 0
        pages = taken[0] if len(taken) == 1 else torch.cat(taken)
        self._num_free -= num_pages
        self.page_state[pages] = _ALLOCATED
        return pages

    def _check_continues(self, position: int, last_slot: int) -> None:
        # Pure host arithmetic on the caller's ints: catches a stale last_slot without a sync.
        if (
            last_slot + 1
        ) % self.page_size != position % self.page_size or last_slot < self.page_size:
            raise ValueError(
                f"last slot {last_slot} cannot precede position {position} "
                f"in a page of {self.page_size}"
            )
