"""The per-batch data of one model forward: token ids, positions, and where KV lives.

A ForwardBatch holds batch data only. Runtime objects (the attention backend, the KV
pools) reach the model through the ForwardContext, never through this object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model_executor.forward_mode import ForwardMode

# The most prompt positions one request gets logits for in one forward (prompt logprobs):
# the scheduler cuts its prefill into chunks of this many, as [rows, vocab] logits are big.
MAX_PROMPT_LOGIT_ROWS = 512


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64, on device; the new tokens of every request
    positions: torch.Tensor  # [num_tokens] int64, on device
    req_pool_indices: torch.Tensor  # [bs] int64, on device; rows of ReqToTokenPool.req_to_token
    seq_lens: torch.Tensor  # [bs] int64, on device; tokens with KV once this forward is done
    out_cache_loc: torch.Tensor  # [num_tokens] int64, on device; KV slots for the new tokens
    seq_lens_cpu: list[int]
    # Per request: how many new tokens this forward computes, and how many tokens before
    # them already have KV in the pool. For DECODE these are all 1 and seq_len - 1.
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    # EXTEND: token-axis indices of prompt positions whose logits prompt logprobs need; the
    # forward returns their logits after those of `last_token_indices`.
    prompt_logit_indices: torch.Tensor | None = None
    # EXTEND: [start, end) token-axis ranges whose hidden states an embedding pools
    # (scheduling/pooling.py); the forward sets `pooled`, each range's rows summed.
    pool_ranges: list[tuple[int, int]] | None = None
    pooled: torch.Tensor | None = None  # [ranges, hidden] float32, on device; set by the forward

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def pool_sums(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each pool range's rows of the final hidden states `hidden` [num_tokens, hidden],
        summed in float32: [ranges, hidden]."""
        assert self.pool_ranges
        return torch.stack([hidden[start:end].float().sum(0) for start, end in self.pool_ranges])

    def last_token_indices(self) -> torch.Tensor:
        """Index into the token axis of the tokens that need logits: each request's last new
        token, or every new token when verifying drafts. [bs] or [num_tokens] int64."""
        if self.forward_mode == ForwardMode.DECODE:
            return torch.arange(self.batch_size, device=self.input_ids.device)
        if self.forward_mode == ForwardMode.TARGET_VERIFY:
            return torch.arange(self.num_tokens, device=self.input_ids.device)
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)

    def logit_indices(self) -> torch.Tensor:
        """The rows the forward returns logits of: `last_token_indices`, then the prompt
        positions of `prompt_logit_indices`."""
        last = self.last_token_indices()
        if self.prompt_logit_indices is None:
            return last
        return torch.cat([last, self.prompt_logit_indices])
