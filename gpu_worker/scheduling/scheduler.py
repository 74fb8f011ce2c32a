"""The engine loop's scheduler: admit, batch, run, sample, finish — one step at a time.

Each step extends (prefill chunks of waiting requests, under a token budget), verifies
drafts (speculative decoding), or decodes every running request by one token. Prefill goes
first, so new requests start quickly. When a decode step finds no KV room, the lowest-class
request with the fewest output tokens is retracted: its KV is released (whole pages stay in
the prefix cache) and it goes back to the front of the queue, to be recomputed and continue
where it stopped. What each sampled
token does to its request (stops, length, text) is outputs.py's.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.memory.radix_cache import RadixCache
from gpu_worker.model_executor.forward_batch import MAX_PROMPT_LOGIT_ROWS, ForwardMode
from gpu_worker.model_executor.model_runner import ModelRunner
from gpu_worker.sampling.logprobs import record_prompt_logprobs
from gpu_worker.sampling.sampler import sample
from gpu_worker.scheduling.fair_share import FairShare
from gpu_worker.scheduling.outputs import append_token, finish_output, sampling_batch
from gpu_worker.scheduling.policy import PrefillCost, order_waiting, shares_prefix_with_batch
from gpu_worker.scheduling.pooling import add_pooled, embedding_of
from gpu_worker.scheduling.req import FinishReason, Req
from gpu_worker.scheduling.request_kv import RequestKV
from gpu_worker.scheduling.schedule_batch import ScheduleBatch
from gpu_worker.speculative import verify
from gpu_worker.speculative.drafter import Drafter, NgramDrafter

logger = logging.getLogger(__name__)

# A waiting request sharing this many uncached tokens with one already in the batch waits a
# step for the cache instead (see shares_prefix_with_batch).
IN_BATCH_PREFIX_MIN_TOKENS = 32


class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig) -> None:
        self.runner = runner
        self.config = config
        prefix_cache = (
            None if config.disable_radix_cache else RadixCache(runner.allocator, runner.page_size)
        )
        self.kv = RequestKV(runner.req_to_token_pool, runner.allocator, prefix_cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.num_retractions = 0
        self.prefill_cost = PrefillCost()  # seconds a prefill token takes here, for spf
        self.fair_share = FairShare()
        self.last_mode: ForwardMode | None = None  # of the last step: what the worker measures
        # The rids in the batch of the step under way or last run (None: while one is formed),
        # so a worker whose step raised knows which requests were in it.
        self.stepping: list[str] | None = None
        self.drafter: Drafter | None = None
        if config.speculative == "ngram":
            self.drafter = NgramDrafter(config.num_draft_tokens, config.speculative_verify)
        elif config.speculative == "draft":
            from gpu_worker.speculative.draft_model import DraftModelDrafter

            self.drafter = DraftModelDrafter(config, runner)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        self.fair_share.tag(req)
        self.waiting.append(req)

    def abort_request(self, rid: str) -> Req | None:
        """Finish `rid` now with reason "abort" and free its KV; None if it is not here."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                return self._finish(req, FinishReason("abort", "aborted by the client"))
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                return self._finish(req, FinishReason("abort", "aborted by the client"))
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            return self._finish(req, FinishReason("abort", "aborted by the client"))
        return None

    def live_requests(self) -> list[Req]:
        chunked = [self.chunked] if self.chunked is not None else []
        return [*self.waiting, *chunked, *self.running]

    def flush_cache(self) -> bool:
        """Empty the prefix cache and return every KV slot; only when no request is live."""
        if self.has_work():
            return False
        if self.kv.prefix_cache is not None:
            self.kv.prefix_cache.reset()
        # With nothing live, every allocated page belonged to the cache: start from clean.
        self.runner.allocator.clear()
        return True

    def reset(self) -> None:
        """Drop every live request and return all KV memory: after a step that raised part-way
        (a request may have left `waiting` without reaching `running`), nothing it held stays
        allocated. The worker re-admits the requests from their published progress."""
        for req in self.live_requests():
            self.abort_request(req.rid)
        self.flush_cache()  # nothing is live now: every page and the prefix cache go back
        self.runner.req_to_token_pool.clear()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def load(self) -> dict[str, int]:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running) + (self.chunked is not None),
            "free_kv_tokens": self.kv.available_tokens(),
        }

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[Req] | None:
        """Run one forward; return the requests that got a token (None: nothing to run)."""
        self.stepping = None
        batch = self.get_next_batch_to_run()
        if batch is None:
            return None
        self.stepping = [req.rid for req in batch.reqs]
        self.last_mode = batch.mode
        started = time.perf_counter()
        forward_batch = batch.to_forward_batch(self.runner.device)
        logits = self.runner.forward(forward_batch)
        if forward_batch.pooled is not None:  # embeddings' hidden states (scheduling/pooling.py)
            add_pooled(batch.reqs, batch.pool_spans, forward_batch.pooled)
        sampled = self.process_batch_result(batch, logits)
        if batch.mode == ForwardMode.EXTEND:  # what spf ages a waiting request by
            self.prefill_cost.record(sum(batch.extend_lens), time.perf_counter() - started)
        elif self.drafter is not None:
            # What each kind of step costs here decides when drafts are worth verifying.
            verify = batch.mode == ForwardMode.TARGET_VERIFY
            seconds = time.perf_counter() - started
            self.drafter.costs.record(verify, len(batch.reqs), sum(batch.extend_lens), seconds)
        return sampled

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.waiting or self.chunked:
            batch = self._prefill_batch()
            if batch is not None:
                return batch
        if self.running:
            if self.drafter is not None:
                batch = self._verify_batch()
                if batch is not None:
                    return batch
            return self._decode_batch()
        return None

    def _prefill_batch(self) -> ScheduleBatch | None:
        budget = self.config.chunked_prefill_size
        reqs: list[Req] = []
        extend_lens: list[int] = []
        locs: list[torch.Tensor] = []
        prefix_lens: list[int] = []

        def add(req: Req, num_new: int, slots: torch.Tensor) -> None:
            nonlocal budget
            reqs.append(req)
            prefix_lens.append(req.kv_len)
            extend_lens.append(num_new)
            locs.append(slots)
            # A request cut short is the batch's last: only one goes on as `chunked`.
            budget = budget - num_new if req.kv_len + num_new == req.num_tokens else 0

        if self.chunked is not None:
            req = self.chunked
            num_new = _chunk_len(req, budget)
            slots = self.kv.alloc_extend(req, num_new)
            if slots is None:
                return None  # decode steps will finish requests and free room
            self.chunked = None
            add(req, num_new, slots)

        ordered = order_waiting(
            list(self.waiting),
            self.config.schedule_policy,
            self.kv.cached_prefix_len,
            self.prefill_cost.per_token,
        )
        if ordered:
            self._preempt_for(ordered[0])
        max_new_reqs = self.config.max_running_requests - len(self.running) - len(reqs)
        for req in ordered:
            if budget <= 0 or max_new_reqs <= 0 or not self.kv.can_attach():
                break
            if self.kv.prefix_cache is not None and shares_prefix_with_batch(
                req, self.kv.cached_prefix_len(req), reqs, IN_BATCH_PREFIX_MIN_TOKENS
            ):
                continue
            if not self.kv.attach(req):
                break
            num_new = _chunk_len(req, budget)
            # Keep a page per running request free so the next decode step does not retract.
            headroom = (len(self.running) + len(reqs) + 1) * self.runner.page_size
            slots = None
            if self.kv.available_tokens() >= num_new + headroom:
                slots = self.kv.alloc_extend(req, num_new)
            if slots is None:
                self.kv.release(req)
                break
            self.waiting.remove(req)
            self.fair_share.admitted(req)
            add(req, num_new, slots)
            max_new_reqs -= 1

        if not reqs:
            return None
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens, torch.cat(locs))

    def _decode_batch(self) -> ScheduleBatch | None:
        while True:
            slots = self.kv.alloc_decode(self.running)
            if slots is not None:
                break
            if len(self.running) == 1:
                # Admission guarantees a lone request fits the pool; reaching this is a bug.
                raise RuntimeError(f"KV pool cannot hold a single request: {self.running[0]}")
            self._retract_one()
        reqs = list(self.running)
        return ScheduleBatch(
            ForwardMode.DECODE,
            reqs,
            [req.kv_len for req in reqs],
            [1] * len(reqs),
            slots,
        )

    def _verify_batch(self) -> ScheduleBatch | None:
        """Each running request's last token and its drafts, in one extend; None when this
        step should decode plainly (few drafts, or no KV room for them)."""
        assert self.drafter is not None
        drafts = self.drafter.propose(self.running, self.runner.context_length)
        if drafts is None:
            return None
        reqs = list(self.running)
        extend_lens = [1 + len(d) for d in drafts]
        slots = self.kv.alloc_extend_all(reqs, extend_lens)
        if slots is None:  # the decode step retracts if even one slot each is too many
            for req in reqs:
                self.drafter.rewind(req, 0)
            return None
        return ScheduleBatch(
            ForwardMode.TARGET_VERIFY,
            reqs,
            [req.kv_len for req in reqs],
            extend_lens,
            slots,
            draft_ids=drafts,
        )

    def _preempt_for(self, req: Req) -> None:
        """Retract running requests of a lower class (a larger `priority`) while `req` could
        not be admitted for want of a batch slot or of KV: a batch line gives way to an
        interactive request, and runs again later to the same output."""
        while True:
            lower = [r for r in self.running if r.priority > req.priority]
            if not lower:
                return
            uncached = req.num_tokens - self.kv.cached_prefix_len(req)
            need = min(uncached, self.config.chunked_prefill_size)
            need += (len(self.running) + 1) * self.runner.page_size  # as admission keeps
            if (len(self.running) < self.config.max_running_requests
                    and self.kv.available_tokens() >= need):  # fmt: skip
                return
            self._retract_one(lower)

    def _retract_one(self, among: list[Req] | None = None) -> None:
        # Of the lowest class (the largest priority), the request with the fewest output
        # tokens (then the longest prompt) loses least work.
        victim = min(among or self.running,
                     key=lambda r: (-r.priority, len(r.output_ids),
                                    -len(r.origin_input_ids)))  # fmt: skip
        self.running.remove(victim)
        self.kv.release(victim)
        self.waiting.appendleft(victim)
        self.num_retractions += 1
        logger.info(
            "retracted %s to free KV (retractions so far: %d)", victim.rid, self.num_retractions
        )

    # ---- results ---------------------------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        if batch.mode == ForwardMode.TARGET_VERIFY:
            return self._process_verify_result(batch, logits)
        spans = batch.prompt_logit_spans  # as the forward was built: before kv_len moves on
        if spans:
            record_prompt_logprobs(batch.reqs, spans, logits[len(batch.reqs) :])
            logits = logits[: len(batch.reqs)]
        rows, sampled, prompt_only = [], [], []
        for i, (req, num_new) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            req.kv_len += num_new
            if batch.mode == ForwardMode.EXTEND:
                self.kv.cache_prefix(req)
            if req.kv_len < req.num_tokens:
                self.chunked = req  # a prefill chunk: nothing to sample yet
            elif req.pooling is not None:  # an embedding: its prefill was all it needed
                req.embedding = embedding_of(req)
                prompt_only.append(self._finish(req, FinishReason("stop")))
            elif req.params.max_new_tokens == 0:  # only its prompt's logprobs were asked for
                prompt_only.append(self._finish(req, FinishReason("length")))
            else:
                rows.append(i)
                sampled.append(req)
        if not sampled:
            return prompt_only
        if len(rows) < len(batch.reqs):
            logits = logits[rows]
        result = self._sample(logits, sampled, [req.output_ids for req in sampled])
        for i, req in enumerate(sampled):
            append_token(req, result.next_token_ids[i], result.logprobs[i],
                         result.top_logprobs[i], self.runner.context_length)  # fmt: skip
            if req.finished:
                self._finish(req, req.finished_reason)
            elif batch.mode == ForwardMode.EXTEND:
                self.running.append(req)  # its prefill is done: it decodes from now on
        if batch.mode == ForwardMode.DECODE:
            self.running = [req for req in self.running if not req.finished]
        return [*prompt_only, *sampled]

    def _process_verify_result(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """Emit each request's accepted drafts and one token of the target's own (see
        speculative/verify.py); the KV of the rejected drafts goes back at once."""
        assert batch.draft_ids is not None and self.drafter is not None
        row_reqs, row_outputs = [], []
        for req, drafts in zip(batch.reqs, batch.draft_ids, strict=True):
            for j in range(len(drafts) + 1):
                # Row j samples as decoding would once drafts 1..j were accepted.
                row_reqs.append(req)
                row_outputs.append(req.output_ids + drafts[:j])
        draft_probs = self.drafter.draft_probs
        if draft_probs is None:
            emitted = verify.by_match(self._sample(logits, row_reqs, row_outputs), batch.draft_ids)
        else:
            emitted = verify.by_rejection(
                logits,
                sampling_batch(
                    row_reqs, row_outputs, self.runner.model_config.vocab_size, logits.device
                ),
                batch.draft_ids,
                [draft_probs.get(req.rid) for req in batch.reqs],
                [req.generator for req in batch.reqs],
                self.default_generator,
            )
        for req, drafts, prefix_len, tokens in zip(
            batch.reqs, batch.draft_ids, batch.prefix_lens, emitted, strict=True
        ):
            appended = 0
            for token, logprob, top_logprobs in tokens:
                append_token(req, token, logprob, top_logprobs, self.runner.context_length)
                appended += 1
                if req.finished:  # a stop inside the accepted run ends the request there
                    break
            accepted = min(appended, len(tokens) - 1)
            self.drafter.record(req, len(drafts), accepted)
            self.drafter.rewind(req, accepted)
            # KV holds the last token and the accepted drafts; the token just emitted gets
            # its KV next step, as in decoding.
            req.kv_len = prefix_len + appended
            self.kv.free_beyond(req, prefix_len + len(drafts) + 1)
            if req.finished:
                self._finish(req, req.finished_reason)
        self.running = [req for req in self.running if not req.finished]
        return list(batch.reqs)

    def _sample(self, logits: torch.Tensor, reqs: list[Req], outputs: list[list[int]]):
        """One token per row; row i belongs to reqs[i] with output tokens outputs[i]."""
        batch = sampling_batch(reqs, outputs, self.runner.model_config.vocab_size, logits.device)
        return sample(logits, batch, self.default_generator, self.runner.cpu_kernels)

    def _finish(self, req: Req, reason: FinishReason) -> Req:
        finish_output(req, reason)
        self.kv.release(req)
        return req


def _chunk_len(req: Req, budget: int) -> int:
    """The new tokens `req` computes in this forward. One that wants prompt logits takes at
    most MAX_PROMPT_LOGIT_ROWS: their logits, [rows, vocab], are the forward's to hold."""
    num_new = min(req.num_tokens - req.kv_len, budget)
    if req.prompt_logits_from < req.num_tokens:
        num_new = min(num_new, MAX_PROMPT_LOGIT_ROWS)
    return num_new
