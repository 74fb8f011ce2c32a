"""The layers that talk between ranks: a row-parallel Linear, a vocabulary-parallel
embedding, and the gather of vocabulary-parallel logits.

Each keeps the parameter names of the layer it replaces (`weight`, `bias`), so checkpoint
names, forward hooks and the CPU kernels' packing (models/layers.py) find what they expect;
only the shapes are a rank's share (parallel/shard.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.layers import Linear
from gpu_worker.parallel.group import tp_group


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the ranks (o_proj, down_proj): each rank
    multiplies its share, the partial sums are all-reduced, and the bias is added once, after
    the reduction, on every rank alike (so the replicated hidden states stay identical)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tp_group().all_reduce(self.project(x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows: this rank holds tokens [start, start + rows) (the
    last rank's tail zero-padded). Ids outside the share look up a zero row, and the all-reduce
    gives every rank the full embedding of every id."""

    def __init__(self, rows: int, start: int, hidden_size: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))
        self.start = start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_group().all_reduce(hidden)


def gather_vocab_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, rows] logits of this rank's vocabulary share -> [n, vocab] of the whole vocabulary
    (the padding past `vocab_size` cut off). Every rank gets them: sampling is rank 0's."""
    return tp_group().all_gather_last_dim(local_logits)[:, :vocab_size]
