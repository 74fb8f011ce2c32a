"""Draft-model drafting: a smaller model sharing the tokenizer proposes k tokens.

The draft model has a ModelRunner of its own (weights, KV pool, request rows). Each
running request has a shadow here (DraftSeq) whose KV follows the target's tokens: one
extend catches it up with the tokens the target accepted since the last step (the whole
prompt the first time) and gives the first draft; k - 1 decode steps give the rest. Each
draft is sampled with the request's own sampling parameters, and its distribution q is
kept for the rejection sampling that verifies it (speculative/verify.py, by_rejection). After
verification the shadow's KV is cut back to the tokens that were accepted.

A grammar request's drafts are sampled under its grammar: each draft step masks the draft
logits in the matcher's state after the drafts before it (consumed, then rolled back), so q
is the masked distribution the drafts were drawn from and every draft is one the grammar
takes. A request stops drafting after a draft that ends it (a stop token, or the grammar's
last token).
"""

from __future__ import annotations

import dataclasses

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.model_executor.forward_batch import ForwardMode
from gpu_worker.model_executor.model_runner import ModelRunner
from gpu_worker.sampling.penalties import SamplingRows
from gpu_worker.sampling.sampler import SamplingBatch, sample, sampling_probs
from gpu_worker.scheduling.req import Req
from gpu_worker.scheduling.request_kv import RequestKV
from gpu_worker.scheduling.schedule_batch import ScheduleBatch
from gpu_worker.speculative.drafter import Drafter


class DraftSeq:
    """The draft model's view of one request: the target's tokens plus this step's drafts,
    with the draft pool's row and KV length (the fields RequestKV and ScheduleBatch use)."""

    def __init__(self, target: Req) -> None:
        self.target = target
        self.drafts: list[int] = []
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.cached_len = 0
        self.last_node = None
        self.prompt_cache_hit: int | None = None
        self.pooling = None  # only generations draft (an embedding never decodes)

    @property
    def origin_input_ids(self) -> list[int]:
        return self.target.origin_input_ids

    @property
    def output_ids(self) -> list[int]:
        return self.target.output_ids + self.drafts

    @property
    def all_ids(self) -> list[int]:
        return self.target.all_ids + self.drafts

    @property
    def num_tokens(self) -> int:
        return self.target.num_tokens + len(self.drafts)

    @property
    def prompt_logits_from(self) -> int:
        return self.num_tokens  # the draft model's logits never score the prompt


class DraftModelDrafter(Drafter):
    drafts_under_grammar = True

    def __init__(self, target_config: EngineConfig, target_runner: ModelRunner) -> None:
        super().__init__(target_config.num_draft_tokens, target_config.speculative_verify)
        if target_config.draft_model is None:
            raise ValueError("draft_model is required with speculative='draft'")
        config = dataclasses.replace(
            target_config,
            model=target_config.draft_model,
            speculative=None,
            draft_model=None,
            disable_radix_cache=True,
            forward_hooks=[],
            tp=1,  # small: rank 0 alone drafts, with the whole draft model
            max_total_tokens=target_runner.max_total_tokens,
            context_length=target_runner.context_length,
        )
        self.runner = ModelRunner(config)
        if self.runner.model_config.vocab_size != target_runner.model_config.vocab_size:
            raise ValueError(
                f"draft_model {config.model!r} has a vocabulary of "
                f"{self.runner.model_config.vocab_size}, the model "
                f"{target_config.model!r} one of {target_runner.model_config.vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        self.kv = RequestKV(self.runner.req_to_token_pool, self.runner.allocator, None)
        self.seqs: dict[str, DraftSeq] = {}
        self.generator = torch.Generator().manual_seed(target_config.seed + 1)
        # Per request of the last proposal: q of each draft, [k, vocab].
        self.draft_probs: dict[str, torch.Tensor] = {}

    def propose(self, reqs: list[Req], context_length: int) -> list[list[int]] | None:
        self._forget_all_but(reqs)
        ks = [self.draft_length(req, context_length) for req in reqs]
        if not any(ks):
            return None
        seqs = [self._seq(req) if k > 0 else None for req, k in zip(reqs, ks, strict=True)]
        active = [(s, k) for s, k in zip(seqs, ks, strict=True) if s is not None]
        if not active:
            return None
        self._draft([s for s, _ in active], [k for _, k in active])
        drafts = [list(s.drafts) if s is not None else [] for s in seqs]
        if not self.worth_verifying(reqs, drafts):
            for seq in seqs:
                if seq is not None:
                    self.rewind(seq.target, 0)
            return None
        return drafts

    def rewind(self, req: Req, accepted: int) -> None:
        """Keep the draft KV of the target's tokens and the `accepted` drafts; drop the rest."""
        seq = self.seqs.get(req.rid)
        if seq is None or not seq.drafts:
            return
        # The KV holds the target's tokens, then drafts 1..k-1 (draft k was never an input);
        # drafts past the accepted ones are not the request's tokens.
        k = len(seq.drafts)
        allocated_end = seq.kv_len
        seq.kv_len -= (k - 1) - min(accepted, k - 1)
        self.kv.free_beyond(seq, allocated_end)
        seq.drafts = []
        self.draft_probs.pop(req.rid, None)

    # ---- internals ---------------------------------------------------------------------

    def _seq(self, req: Req) -> DraftSeq | None:
        seq = self.seqs.get(req.rid)
        if seq is None:
            seq = DraftSeq(req)
            if not self.kv.attach(seq):
                return None
            self.seqs[req.rid] = seq
        return seq

    def _forget_all_but(self, reqs: list[Req]) -> None:
        """Release the shadows of requests that finished, left, or were retracted."""
        live = {req.rid: req for req in reqs}
        for rid in list(self.seqs):
            if live.get(rid) is not self.seqs[rid].target:
                self.kv.release(self.seqs.pop(rid))
                self.draft_probs.pop(rid, None)

    def _draft(self, seqs: list[DraftSeq], ks: list[int]) -> None:
        # Catch up: the draft KV gets every target token; the last one's logits give draft 1.
        batch = self._batch(ForwardMode.EXTEND, seqs, [s.num_tokens - s.kv_len for s in seqs])
        if batch is None:
            return
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        self._sample_into(batch, seqs, probs)
        for step in range(1, max(ks)):
            going = [i for i, k in enumerate(ks) if k > step and self._drafts_on(seqs[i])]
            if not going:
                break
            batch = self._batch(ForwardMode.DECODE, [seqs[i] for i in going], [1] * len(going))
            if batch is None:
                break
            self._sample_into(batch, [seqs[i] for i in going], [probs[i] for i in going])
        for seq, q in zip(seqs, probs, strict=True):
            if q:
                self.draft_probs[seq.target.rid] = torch.stack(q)

    @staticmethod
    def _drafts_on(seq: DraftSeq) -> bool:
        """Whether a draft past `seq`'s drafts could be emitted: not after a stop token, nor
        after the drafts complete the request's grammar (the request ends there)."""
        if not seq.drafts or seq.drafts[-1] in seq.target.stop_ids:
            return False
        matcher = seq.target.matcher
        if matcher is None:
            return True
        matcher.consume_tokens(seq.drafts)  # drafted under its mask: it takes them
        complete = matcher.is_stopped()
        matcher.rollback(len(seq.drafts))
        return not complete

    def _batch(self, mode: ForwardMode, seqs: list[DraftSeq], lens: list[int]):
        slots = self.kv.alloc_extend_all(seqs, lens)
        if slots is None:  # no draft KV room: no drafts this step
            return None
        return ScheduleBatch(mode, seqs, [s.kv_len for s in seqs], lens, slots)

    def _sample_into(self, batch: ScheduleBatch, seqs: list[DraftSeq], probs) -> None:
        logits = self.runner.forward(batch.to_forward_batch(self.runner.device))
        for seq, n in zip(seqs, batch.extend_lens, strict=True):
            seq.kv_len += n
        rows = SamplingRows(
            [s.target.params for s in seqs],
            [s.origin_input_ids for s in seqs],
            [s.output_ids for s in seqs],
            [s.target.blocked_until_min_tokens(len(s.output_ids)) for s in seqs],
            matchers=[s.target.matcher for s in seqs],
            drafts_before=[s.drafts for s in seqs],
            biases=[s.target.logit_bias for s in seqs],
        )
        sampling = SamplingBatch.build(
            rows,
            [None] * len(seqs),  # the request's own generator is the target's to use
            self.runner.model_config.vocab_size,
            logits.device,
        )
        q = sampling_probs(logits, sampling)
        tokens = sample(logits, sampling, self.generator, self.runner.cpu_kernels).next_token_ids
        for i, seq in enumerate(seqs):
            seq.drafts.append(tokens[i])
            probs[i].append(q[i])
