"""One forward, as rank 0 sends it to a follower: the ForwardBatch's inputs, and the
request-row writes (ReqToTokenPool) made since the last one.

A follower has its own ReqToTokenPool and KV pool (its heads of every slot), but no
scheduler: slots are handed out on rank 0 alone, and the rows that say which slots a request
reads reach a follower as the writes that made them, in order (rows of the prefix cache, of
each extend and decode, the prefix cache's rewrites). That is all the bookkeeping there is
to mirror: nothing outside a forward writes the KV pool itself (the allocator and prefix
cache only hand out and take back slots, and a rejected draft's slots are just freed).

Everything travels as numpy arrays and plain lists, so pickling copies the values (a torch
tensor would go through torch's shared-memory reduction instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch
from gpu_worker.model_executor.forward_mode import ForwardMode


@dataclass
class StepMessage:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    req_pool_indices: np.ndarray  # [bs] int64
    seq_lens: np.ndarray  # [bs] int64
    out_cache_loc: np.ndarray  # [num_tokens] int64
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    prompt_logit_indices: np.ndarray | None
    # ReqToTokenPool writes since the last step, in order: (rows, positions, slots) each.
    row_writes: list[tuple[np.ndarray, np.ndarray, np.ndarray]]

    @classmethod
    def of(cls, batch: ForwardBatch, pool: ReqToTokenPool) -> StepMessage:
        """The message for `batch`; takes (and empties) `pool`'s journal of writes."""
        assert pool.journal is not None, "rank 0's ReqToTokenPool must keep a journal"
        writes = [tuple(_host(t) for t in write) for write in pool.journal]
        pool.journal.clear()
        prompt_rows = batch.prompt_logit_indices
        return cls(
            forward_mode=batch.forward_mode,
            batch_size=batch.batch_size,
            input_ids=_host(batch.input_ids),
            positions=_host(batch.positions),
            req_pool_indices=_host(batch.req_pool_indices),
            seq_lens=_host(batch.seq_lens),
            out_cache_loc=_host(batch.out_cache_loc),
            seq_lens_cpu=list(batch.seq_lens_cpu),
            extend_seq_lens_cpu=list(batch.extend_seq_lens_cpu),
            extend_prefix_lens_cpu=list(batch.extend_prefix_lens_cpu),
            prompt_logit_indices=None if prompt_rows is None else _host(prompt_rows),
            row_writes=writes,  # type: ignore[arg-type]
        )

    def apply_row_writes(self, pool: ReqToTokenPool) -> None:
        table = pool.req_to_token
        for rows, positions, slots in self.row_writes:
            device = table.device
            table[_dev(rows, device), _dev(positions, device)] = _dev(slots, device)

    def forward_batch(self, device: torch.device) -> ForwardBatch:
        """The ForwardBatch rank 0 ran (without embedding pooling: that is rank 0's)."""
        prompt_rows = self.prompt_logit_indices
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=self.batch_size,
            input_ids=_dev(self.input_ids, device),
            positions=_dev(self.positions, device),
            req_pool_indices=_dev(self.req_pool_indices, device),
            seq_lens=_dev(self.seq_lens, device),
            out_cache_loc=_dev(self.out_cache_loc, device),
            seq_lens_cpu=self.seq_lens_cpu,
            extend_seq_lens_cpu=self.extend_seq_lens_cpu,
            extend_prefix_lens_cpu=self.extend_prefix_lens_cpu,
            prompt_logit_indices=None if prompt_rows is None else _dev(prompt_rows, device),
        )


def _host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.int64).numpy()  # host sync on CUDA


def _dev(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)
