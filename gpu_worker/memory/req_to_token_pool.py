"""ReqToTokenPool: one row per running request, mapping token position -> KV slot.

Attention backends read a request's KV through its row, so the row is the only place that
says where a request's tokens live; the prefix cache and the allocator only hand out slots.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Maps (request slot, token position) -> KV slot."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        if size < 1 or max_context_len < 1:
            raise ValueError(
                f"size and max_context_len must be >= 1, got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # Zeros point at the padding page, so a stale read of an unused row is harmless.
        self.req_to_token = torch.zeros(
            (size, max_context_len), dtype=torch.int64, device=self.device
        )  # [size, max_context_len]
        self._is_free = [True] * size
        # When a list, every write is also recorded in it, in order, for a tensor-parallel
        # follower's copy of the table (gpu_worker/parallel/step_message.py); None: off.
        self.journal: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        # Popped from the end: reversed so the first request gets row 0 (easier to read in logs).
        self._free_rows = list(range(size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free request row, or None when every row is taken."""
        if not self._free_rows:
            return None
        index = self._free_rows.pop()
        self._is_free[index] = False
        return index

    def free(self, index: int) -> None:
        if not 0 <= index < self.size:
            raise IndexError(f"request row {index} out of range [0, {self.size})")
        if self._is_free[index]:
            # A row freed twice would later be handed to two requests at once.
            raise RuntimeError(f"request row {index} freed twice")
        self._is_free[index] = True
        self._free_rows.append(index)

    def write(self, index: int, start: int, slots: torch.Tensor) -> None:
        """req_to_token[index, start : start + len(slots)] = slots."""
        end = start + len(slots)
        if start < 0 or end > self.max_context_len:
            raise IndexError(
                f"positions [{start}, {end}) do not fit a row of {self.max_context_len} tokens"
            )
        self.req_to_token[index, start:end] = slots
        if self.journal is not None:
            rows = torch.full((len(slots),), index, dtype=torch.int64)
            self.journal.append((rows, torch.arange(start, end), slots.to("cpu", copy=True)))

    def write_positions(
        self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """req_to_token[rows[i], positions[i]] = slots[i] for each i (one slot per row)."""
        self.req_to_token[rows, positions] = slots
        if self.journal is not None:
            self.journal.append((rows.cpu(), positions.cpu(), slots.to("cpu", copy=True)))

    def clear(self) -> None:
        self._is_free = [True] * self.size
        self._free_rows = list(range(self.size - 1, -1, -1))
