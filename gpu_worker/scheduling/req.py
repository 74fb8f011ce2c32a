"""Req: one generation request as the scheduler tracks it, in token counts.

`kv_len` tokens of `all_ids` have KV in the pool; the first `cached_len` of those belong to
the prefix cache (locked through `last_node`), the rest to this request. A request needs
computing while kv_len < num_tokens; one rule covers prefill, chunked prefill, prefix hits,
decode and recompute after retraction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobs.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

    from gpu_worker.sampling.logit_bias import LogitBias
    from gpu_worker.speculative.draft_state import DraftState
    from gpu_worker.text_stream import TextStream


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort" | "error" (the request's fault, found as it ran)
    # The stop token id or stop string that ended the request, or an abort's or error's message.
    matched: int | str | None = None
    param: str | None = None  # an error's field at fault


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        eos_ids: frozenset[int],
        generator: torch.Generator | None = None,
        text_stream: TextStream | None = None,
        matcher: LLMatcher | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.arrived = time.monotonic()  # the "spf" policy's aging (scheduling/policy.py)
        self.params = params
        self.generator = generator
        self.text_stream = text_stream
        self.output_ids: list[int] = []
        # Tokens whose generation stops the request (unless min_new_tokens holds them back).
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_ids
        )
        # The grammar's matcher (sampling/grammar.py), in the state after output_ids; None
        # when the request has no grammar.
        self.matcher = matcher
        self.logit_bias = _logit_bias(params)  # as tensors, once (sampling/logit_bias.py)

        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.last_node: Any = None
        # Prompt tokens served from the prefix cache at first admission (reported in usage).
        self.prompt_cache_hit: int | None = None

        self.finished_reason: FinishReason | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        # With params.prompt_logprobs: entry p is prompt token p+1's, from the logits at
        # position p. None where they are not wanted, or were published already (a request
        # resumed after its first tokens).
        self.prompt_logprobs: list[float] | None = [] if params.prompt_logprobs else None
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        # Text produced by the text stream but not yet handed to the caller, piece by piece
        # (a str grown with += is copied whole each token; the worker stage never drains it).
        self.pending_text: list[str] = []
        # Speculative decoding's per-request state, made at its first draft.
        self.draft: DraftState | None = None
        # The scheduler's, beside the sampler's parameters: its class (scheduling/policy.py;
        # a worker sets its job's), and, for fair share between tenants
        # (scheduling/fair_share.py), whose request this is, its tenant's weight, and its
        # start tag in the waiting queue.
        self.priority = params.priority
        self.tenant = ""
        self.weight = 1.0
        self.fair_tag = 0.0
        # An embedding request's (scheduling/pooling.py): its pooling, "mean" or "last" (None:
        # it generates), the float32 sum of the hidden states pooled so far, and, once its
        # prefill is done, the normalized vector as packed float32.
        self.pooling: str | None = None
        self.pooled: torch.Tensor | None = None
        self.embedding: bytes | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prompt_logits_from(self) -> int:
        """The first position whose logits the prompt logprobs still need; num_tokens if
        none. Neither the prefix cache nor a retraction's recompute may skip past it."""
        if self.prompt_logprobs is None:
            return self.num_tokens
        done = len(self.prompt_logprobs)
        return done if done < len(self.origin_input_ids) - 1 else self.num_tokens

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def blocked_until_min_tokens(self, num_out: int | None = None) -> list[int]:
        """Stop ids to mask while the request (or its `num_out` tokens, drafts included) is
        still short of min_new_tokens."""
        if (len(self.output_ids) if num_out is None else num_out) >= self.params.min_new_tokens:
            return []
        return sorted(self.stop_ids)

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
            f"kv={self.kv_len}, cached={self.cached_len})"
        )


def _logit_bias(params: SamplingParams) -> LogitBias | None:
    if not params.logit_bias:
        return None
    # Imported here, as only a bias needs torch: Req itself imports without it, so the
    # synthetic engine (gpu_worker/synthetic_engine.py) runs with no torch loaded.
    from gpu_worker.sampling.logit_bias import LogitBias

    return LogitBias.of(params)
