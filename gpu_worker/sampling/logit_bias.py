"""A request's logit_bias as tensors, built once when the request is made.

A request may bias up to `STREAMSERVE_MAX_LOGIT_BIAS` tokens (docs/BOUNDS.md). Walking that
dict in Python for every row of every step made a hostile request's bias a per-step CPU cost
in the engine thread; here each request's entries become two CPU tensors once, and a step
joins the rows' tensors with one `torch.cat` and adds them with one `index_put_`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobs.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitBias:
    tokens: torch.Tensor  # [k] int64, on cpu
    values: torch.Tensor  # [k] float32, on cpu

    @classmethod
    def of(cls, params: SamplingParams) -> LogitBias | None:
        """`params.logit_bias` as tensors; None when it is empty."""
        if not params.logit_bias:
            return None
        return cls(
            torch.tensor(list(params.logit_bias.keys()), dtype=torch.int64),
            torch.tensor(list(params.logit_bias.values()), dtype=torch.float32),
        )


def batch_bias(
    biases: list[LogitBias | None], device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows [n] int64, cols [n] int64, values [n] float32) on `device`: every row's bias
    cells of a batch whose row i has biases[i]; None when no row has one. Python work is per
    biased row, not per entry."""
    rows = [row for row, bias in enumerate(biases) if bias is not None]
    if not rows:
        return None
    chosen = [biases[row] for row in rows]
    counts = torch.tensor([len(bias.tokens) for bias in chosen], dtype=torch.int64)
    row_index = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)
    cols = torch.cat([bias.tokens for bias in chosen])
    values = torch.cat([bias.values for bias in chosen])
    return row_index.to(device), cols.to(device), values.to(device)
