"""ScheduleBatch: the requests chosen for one forward, turned into a ForwardBatch."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.scheduling.pooling import pool_spans
from gpu_worker.scheduling.req import Req


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]  # kv_len of each request before this forward
    extend_lens: list[int]  # new tokens each request computes
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64 KV slots
    # TARGET_VERIFY: the tokens drafted after each request's last token.
    draft_ids: list[list[int]] | None = None

    @functools.cached_property
    def prompt_logit_spans(self) -> list[tuple[int, int, int]]:
        """(request row, first position, end position) of the prompt positions whose logits
        this forward must return for prompt logprobs: each wanted position it computes, up
        to the prompt's last but one (the last one's logits give the first output token).
        Read once, before the forward, for its rows and again for its results."""
        if self.mode != ForwardMode.EXTEND:
            return []
        spans = []
        for i, (req, prefix, new) in enumerate(
            zip(self.reqs, self.prefix_lens, self.extend_lens, strict=True)
        ):
            start = max(prefix, req.prompt_logits_from)
            end = min(prefix + new, len(req.origin_input_ids) - 1)
            if start < end:
                spans.append((i, start, end))
        return spans

    @functools.cached_property
    def pool_spans(self) -> list[tuple[int, int, int]]:
        """(request row, first position, end position) of the positions this forward pools
        for embedding requests (scheduling/pooling.py)."""
        if self.mode != ForwardMode.EXTEND:
            return []
        return pool_spans(self.reqs, self.prefix_lens, self.extend_lens)

    def to_forward_batch(self, device: torch.device) -> ForwardBatch:
        seq_lens = [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]
        if self.mode == ForwardMode.DECODE:
            input_ids = [
                req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]
                for req in self.reqs
            ]
            positions = torch.tensor(self.prefix_lens, dtype=torch.int64)
        else:
            input_ids = []
            if self.mode == ForwardMode.TARGET_VERIFY:
                assert self.draft_ids is not None
                for req, drafts in zip(self.reqs, self.draft_ids, strict=True):
                    input_ids += [(req.output_ids or req.origin_input_ids)[-1], *drafts]
            else:
                for req, start, end in zip(self.reqs, self.prefix_lens, seq_lens, strict=True):
                    input_ids.extend(_slice_ids(req, start, end))
            positions = torch.cat(
                [
                    torch.arange(p, s, dtype=torch.int64)
                    for p, s in zip(self.prefix_lens, seq_lens, strict=True)
                ]
            )
        prompt_rows = None
        spans = self.prompt_logit_spans
        if spans:
            offsets = [0, *itertools.accumulate(self.extend_lens)]
            prompt_rows = torch.cat([
                torch.arange(start, end, dtype=torch.int64) + offsets[i] - self.prefix_lens[i]
                for i, start, end in spans
            ]).to(device, non_blocking=True)  # fmt: skip
        pool_ranges = None
        if self.pool_spans:  # token-axis ranges: where each request's new tokens begin
            offsets = [0, *itertools.accumulate(self.extend_lens)]
            pool_ranges = [(offsets[i] + start - self.prefix_lens[i],
                            offsets[i] + end - self.prefix_lens[i])
                           for i, start, end in self.pool_spans]  # fmt: skip
        return ForwardBatch(
            forward_mode=self.mode,
            batch_size=len(self.reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
            positions=positions.to(device, non_blocking=True),
            req_pool_indices=torch.tensor(
                [req.req_pool_idx for req in self.reqs], dtype=torch.int64
            ).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device, non_blocking=True),
            out_cache_loc=self.out_cache_loc,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(self.extend_lens),
            extend_prefix_lens_cpu=list(self.prefix_lens),
            prompt_logit_indices=prompt_rows,
            pool_ranges=pool_ranges,
        )


def _slice_ids(req: Req, start: int, end: int) -> list[int]:
    prompt = req.origin_input_ids
    if end <= len(prompt):
        return prompt[start:end]
    return req.all_ids[start:end]
