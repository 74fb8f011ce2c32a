"""Batched sampling with per-request settings.

Per step: logit_bias -> repetition penalty -> frequency/presence -> min-tokens mask (see
penalties.py), then greedy rows take the argmax and sampled rows go through
temperature -> top-k -> top-p -> min-p -> one inverse-CDF draw. Logprobs come from the raw
logits (see logprobs.py).

Reproducibility: a sampled row draws exactly one uniform per token, from its request's own
generator when it has a seed (else from the engine's default generator), and every tensor
operation works row by row (the sort is stable, so ties order the same way whatever the
neighbours), so a seeded request gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpu_worker.kernels.cpu_kernels import CpuKernels
from gpu_worker.sampling.logprobs import TopLogprobs, gather_logprobs
from gpu_worker.sampling.penalties import LogitAdjustments, SamplingRows


@dataclass
class SamplingBatch:
    """Everything `sample` needs for one step, built once for the rows being sampled."""

    vocab_size: int
    adjustments: LogitAdjustments | None  # None: no row has bias, penalties or a min-tokens mask
    sampled_rows: list[int]  # rows that draw a token; the others are greedy
    sampled_index: torch.Tensor | None  # [n] int64 on device: sampled_rows as a tensor
    # The rest are per sampled row, [n, 1] on device; None when no sampled row uses them.
    temperature: torch.Tensor | None  # float32
    top_k: torch.Tensor | None  # int64, vocab_size where off
    top_p: torch.Tensor | None  # float32, inf where off (1.0 would still cut float noise)
    min_p: torch.Tensor | None  # float32
    generators: list[torch.Generator | None]  # per sampled row, on cpu
    want_logprobs: list[bool]  # per row
    top_logprobs: list[int]  # per row

    @classmethod
    def build(
        cls,
        rows: SamplingRows,
        generators: list[torch.Generator | None],  # per row: a seeded request's own
        vocab_size: int,
        device,
    ) -> SamplingBatch:
        adjustments = LogitAdjustments.build(rows, vocab_size, device)
        params = rows.params
        sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        sampled = [params[row] for row in sampled_rows]
        sampled_index = temperature = top_k = top_p = min_p = None
        if sampled_rows:
            sampled_index = torch.tensor(sampled_rows, dtype=torch.int64, device=device)
            temperature = _column([p.temperature for p in sampled], torch.float32, device)
            if any(p.top_k is not None and p.top_k < vocab_size for p in sampled):
                top_k = _column(
                    [vocab_size if p.top_k is None else p.top_k for p in sampled],
                    torch.int64,
                    device,
                )
            if any(p.top_p < 1.0 for p in sampled):
                top_p = _column(
                    [p.top_p if p.top_p < 1.0 else math.inf for p in sampled],
                    torch.float32,
                    device,
                )
            if any(p.min_p > 0.0 for p in sampled):
                min_p = _column([p.min_p for p in sampled], torch.float32, device)
        return cls(
            vocab_size=vocab_size,
            adjustments=adjustments,
            sampled_rows=sampled_rows,
            sampled_index=sampled_index,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=[generators[row] for row in sampled_rows],
            want_logprobs=[p.logprobs for p in params],
            top_logprobs=[p.top_logprobs if p.logprobs else 0 for p in params],
        )


@dataclass
class SampleOutput:
    next_token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's logprob; None where not asked
    top_logprobs: list[TopLogprobs | None]  # (id, logprob), most likely first; None if not asked


def sample(
    logits: torch.Tensor,  # [bs, vocab] float32
    batch: SamplingBatch,
    default_generator: torch.Generator,  # on cpu; draws for rows without a seed
    cpu_kernels: CpuKernels | None = None,  # their argmax reads CPU logits at memory speed
) -> SampleOutput:
    if logits.shape[-1] != batch.vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, expected {batch.vocab_size}")
    raw = logits.float()
    if batch.adjustments is None:
        processed = raw  # the all-greedy fast path ends in a bare argmax
    else:
        processed = batch.adjustments.apply(raw.clone(), cpu_kernels)
    if len(batch.sampled_rows) == logits.shape[0]:
        next_ids = _sample_rows(processed, batch, default_generator)
    else:
        if cpu_kernels is not None and processed.device.type == "cpu":
            next_ids = cpu_kernels.argmax(processed)
        else:
            next_ids = processed.argmax(dim=-1)
        if batch.sampled_rows:
            drawn = _sample_rows(processed[batch.sampled_index], batch, default_generator)
            next_ids[batch.sampled_index] = drawn
    token_ids = next_ids.tolist()  # host sync
    logprobs, top_logprobs = gather_logprobs(raw, next_ids, batch.want_logprobs, batch.top_logprobs)
    return SampleOutput(token_ids, logprobs, top_logprobs)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row's token is drawn from, [bs, vocab] float32: after the
    logit adjustments, temperature and filters; one-hot at the argmax for greedy rows.
    Speculative decoding's rejection sampling compares these of draft and target."""
    processed = logits.float()
    if batch.adjustments is not None:
        processed = batch.adjustments.apply(processed.clone())
    probs = torch.zeros_like(processed)
    probs.scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
    if batch.sampled_rows:
        sorted_logits, sorted_ids = _filtered_sorted(processed[batch.sampled_index], batch)
        drawn = torch.zeros_like(sorted_logits).scatter_(1, sorted_ids, sorted_logits.softmax(-1))
        probs[batch.sampled_index] = drawn
    return probs


def _filtered_sorted(
    logits: torch.Tensor,  # [n, vocab], the sampled rows only; not modified
    batch: SamplingBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' logits after temperature and the filters (-inf where cut), sorted
    descending, with the token ids in that order."""
    logits = logits / batch.temperature
    # Filters keep a prefix of the tokens sorted by logit, so they all work on one sort.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if batch.top_k is not None:
        ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks >= batch.top_k, -math.inf)
    if batch.top_p is not None:
        # Drop a token once the tokens before it already hold more than top_p of the mass;
        # the first token has zero mass before it, so one token always survives.
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(mass_before > batch.top_p, -math.inf)
    if batch.min_p is not None:
        # p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p): the softmax normaliser cancels,
        # so no renormalisation after top-k/top-p is needed. min_p = 0 gives -inf: keep all.
        threshold = sorted_logits[:, :1] + torch.log(batch.min_p)
        sorted_logits.masked_fill_(sorted_logits < threshold, -math.inf)
    return sorted_logits, sorted_ids


def _sample_rows(
    logits: torch.Tensor,  # [n, vocab], the sampled rows only; not modified
    batch: SamplingBatch,
    default_generator: torch.Generator,
) -> torch.Tensor:  # [n] int64
    sorted_logits, sorted_ids = _filtered_sorted(logits, batch)
    # Inverse CDF: the first sorted token whose cumulative probability exceeds u * total.
    cdf = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    u = _uniforms(batch.generators, default_generator).to(logits.device)
    choice = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True)
    # u * total can round up to total, which lands past the last kept token; clamp to it.
    kept = (sorted_logits > -math.inf).sum(dim=-1, keepdim=True)
    choice = torch.minimum(choice, kept - 1).clamp_(min=0)
    return sorted_ids.gather(1, choice).squeeze(1)


def _uniforms(
    generators: list[torch.Generator | None], default_generator: torch.Generator
) -> torch.Tensor:  # [n] float32, on cpu
    """One uniform in [0, 1) per row: seeded rows from their own generator, one draw each."""
    u = torch.empty(len(generators), dtype=torch.float32)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=default_generator)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand(1, generator=generator)[0]
    return u


def _column(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the distribution `probs` ([vocab], need not sum to 1), by inverse CDF
    with one uniform from `generator` (on cpu)."""
    cdf = probs.float().cumsum(dim=0)
    u = torch.rand(1, generator=generator).to(probs.device)
    choice = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(choice, int((probs > 0).nonzero()[-1]))
