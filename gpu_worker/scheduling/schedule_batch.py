"""ScheduleBatch: the requests chosen for one forward, turned into a ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode
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
        )


def _slice_ids(req: Req, start: int, end: int) -> list[int]:
    prompt = req.origin_input_ids
    if end <= len(prompt):
        return prompt[start:end]
    return req.all_ids[start:end]
