"""Logit edits that come from a request's settings and history, applied before sampling.

In order: logit_bias, the repetition penalty, frequency/presence penalties, the min-tokens
mask, the grammar mask (grammar.py). Each is built only when some row in the batch uses it,
so a batch that uses none costs nothing here. Every tensor is per row, so a row's result
never depends on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpu_worker.sampling.grammar import GrammarMask
from gpu_worker.sampling.logit_bias import LogitBias, batch_bias
from jobs.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from gpu_worker.kernels.cpu_kernels import CpuKernels


@dataclass
class SparseEdit:
    """A few (row, token) cells of the logits; built from Python lists in one copy each."""

    rows: torch.Tensor  # [n] int64, on the logits' device
    cols: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] float32, or a 0-dim tensor broadcast to every cell

    @classmethod
    def build(
        cls, rows: list[int], cols: list[int], values: list[float] | float, device
    ) -> SparseEdit | None:
        if not rows:
            return None
        return cls(
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device),
        )


@dataclass
class SamplingRows:
    """What sampling reads of each row's request: its settings and its token history."""

    params: list[SamplingParams]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    blocked_until_min_tokens: list[list[int]]  # stop ids masked while below min_new_tokens
    # Per row, the grammar's matcher in the state after the request's own output; None: no
    # grammar. A verify step's rows go past that output by the drafts before them.
    matchers: list[LLMatcher | None] = field(default_factory=list)
    drafts_before: list[list[int]] = field(default_factory=list)
    # Per row, its request's logit_bias as tensors (Req.logit_bias, built once per request);
    # None: built from params here.
    biases: list[LogitBias | None] | None = None


@dataclass
class LogitAdjustments:
    bias: SparseEdit | None  # added to the logits
    repetition: torch.Tensor | None  # [bs, 1] float32, 1.0 on rows without the penalty
    seen: torch.Tensor | None  # [bs, vocab] bool: the token is in prompt + output
    frequency: torch.Tensor | None  # [bs, 1] float32
    presence: torch.Tensor | None  # [bs, 1] float32
    counts: torch.Tensor | None  # [bs, vocab] float32: occurrences in the output
    min_tokens_mask: SparseEdit | None  # cells set to -inf
    grammar: GrammarMask | None  # cells the grammar does not allow set to -inf

    @classmethod
    def build(cls, rows: SamplingRows, vocab_size: int, device) -> LogitAdjustments | None:
        """None when no row needs any edit (the sampler's fast path)."""
        params, prompt_ids, output_ids = rows.params, rows.prompt_ids, rows.output_ids
        biases = rows.biases if rows.biases is not None else [LogitBias.of(p) for p in params]
        cells = batch_bias(biases, device)
        bias = None if cells is None else SparseEdit(*cells)
        mask_rows, mask_cols = [], []
        for row, blocked in enumerate(rows.blocked_until_min_tokens):
            mask_rows.extend([row] * len(blocked))
            mask_cols.extend(blocked)

        bs = len(params)
        repetition = seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = _column([p.repetition_penalty for p in params], device)
            seen_rows, seen_cols = [], []
            for row, p in enumerate(params):
                if p.repetition_penalty != 1.0:
                    history = prompt_ids[row] + output_ids[row]
                    seen_rows.extend([row] * len(history))
                    seen_cols.extend(history)
            seen = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
            seen[_indices(seen_rows, device), _indices(seen_cols, device)] = True

        frequency = presence = counts = None
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency = _column([p.frequency_penalty for p in params], device)
            presence = _column([p.presence_penalty for p in params], device)
            out_rows, out_cols = [], []
            for row, p in enumerate(params):
                if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                    out_rows.extend([row] * len(output_ids[row]))
                    out_cols.extend(output_ids[row])
            counts = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
            counts.index_put_(
                (_indices(out_rows, device), _indices(out_cols, device)),
                torch.ones(len(out_rows), dtype=torch.float32, device=device),
                accumulate=True,
            )

        min_tokens_mask = SparseEdit.build(mask_rows, mask_cols, float("-inf"), device)
        grammar = GrammarMask.build(rows.matchers, vocab_size, device, rows.drafts_before)
        edits = (bias, repetition, counts, min_tokens_mask, grammar)
        if all(edit is None for edit in edits):
            return None
        return cls(bias, repetition, seen, frequency, presence, counts, min_tokens_mask, grammar)

    def apply(self, logits: torch.Tensor, cpu_kernels: CpuKernels | None = None) -> torch.Tensor:
        """Edit `logits` ([bs, vocab] float32, owned by the caller) in place and return it;
        `cpu_kernels` apply the grammar mask on CPU."""
        if self.bias is not None:
            logits.index_put_((self.bias.rows, self.bias.cols), self.bias.values, accumulate=True)
        if self.repetition is not None:
            # HF (CTRL paper): a seen token's logit moves towards "less likely" whatever its
            # sign: l > 0 -> l / p, l <= 0 -> l * p.
            penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(self.seen, penalized, logits)
        if self.counts is not None:
            # OpenAI: l -= count * frequency_penalty + (count > 0) * presence_penalty.
            logits -= self.counts * self.frequency + (self.counts > 0) * self.presence
        if self.min_tokens_mask is not None:
            mask = self.min_tokens_mask
            logits.index_put_((mask.rows, mask.cols), mask.values)
        if self.grammar is not None:
            self.grammar.apply(logits, cpu_kernels)
        return logits


def _column(values: list[float], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _indices(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
