"""Engine: the in-process, offline API over the scheduler and model runner.

    engine = Engine(model="smollm2-135m-instruct")
    engine.generate(["Hello"], {"temperature": 0, "max_new_tokens": 32})
    for chunk in engine.generate_stream("Hello", {"max_new_tokens": 32}): ...
    engine.embed(["Hello", "World"], pooling="mean")  # L2-normalized pooled hidden states

The engine is synchronous: a call steps the shared scheduler until its own requests are
done, so requests from interleaved calls batch together. Use it from one thread.

A request is read by jobs/request_normaliser.py, as the pipeline reads it (its tokenizer
stage, and the worker stage through `sampling_params` and `build_request`): the same
defaults (a missing ``max_new_tokens`` is all that fit the context and the KV pool) and the
same checks, each mistake a FieldError naming its field.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from gpu_worker.config import DEFAULT_MODEL, EngineConfig
from gpu_worker.model_executor.model_runner import ModelRunner
from gpu_worker.sampling.grammar import Grammars
from gpu_worker.scheduling.req import Req
from gpu_worker.scheduling.scheduler import Scheduler
from gpu_worker.speculative.drafter import speculative_usage
from gpu_worker.text_stream import TextStream
from jobs.field_error import FieldError
from jobs.request_normaliser import (
    ModelLimits,
    check_fits,
    check_request,
    check_resumed_ids,
    check_token_ids,
    encode_prompts,
    sampling_maps,
    split_prompts,
)
from jobs.request_normaliser import sampling_params as params_with_defaults
from jobs.requests import POOLINGS
from jobs.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

Prompts = str | Sequence[str] | None  # one text prompt, or a list of them
TokenPrompts = Sequence[int] | Sequence[Sequence[int]]
Sampling = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None  # one for all, or one each


class Inputs(TypedDict, total=False):
    """The prompts as token ids or as chats, instead of text: one kind per call."""

    input_ids: TokenPrompts
    messages: Sequence[Any]  # a conversation of {role, content} dicts, or a list of them
    tools: Sequence[Mapping[str, Any]]  # with messages: the functions it may call (OpenAI's)


class Engine:
    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **options)
        self.runner = ModelRunner(self.config)
        self.scheduler = Scheduler(self.runner, self.config)
        self.tokenizer = self.runner.tokenizer
        self.vocab_size = self.runner.model_config.vocab_size
        eos = set(self.runner.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        # What the request normaliser checks against (jobs/request_normaliser.py).
        self.limits = ModelLimits(
            self.vocab_size, self.runner.context_length, self.runner.max_total_tokens
        )

    # ---- public API ------------------------------------------------------------------------

    def generate(
        self, prompt: Prompts = None, sampling_params: Sampling = None, **inputs: Unpack[Inputs]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Run to completion. One prompt gives one dict; a list gives a list in order."""
        reqs, single = self._submit(prompt, sampling_params, **inputs)
        results = [self._result(req) for req in self._run(reqs)]
        return results[0] if single else results

    def embed(
        self, prompt: Prompts = None, pooling: str = "mean", **inputs: Unpack[Inputs]
    ) -> list[float] | list[list[float]]:
        """Each prompt's embedding: its final hidden states pooled over the prompt (`pooling`
        "mean" or "last") and L2-normalized (gpu_worker/scheduling/pooling.py). One prompt
        gives one vector; a list gives a list in order."""
        if pooling not in POOLINGS:
            raise FieldError("pooling", f"pooling must be one of {', '.join(POOLINGS)}")
        reqs, single = self._submit(prompt, {"max_new_tokens": 0}, pooling=pooling, **inputs)
        vectors = [np.frombuffer(req.embedding, "<f4").tolist() for req in self._run(reqs)]
        return vectors[0] if single else vectors

    def generate_stream(
        self, prompt: Prompts = None, sampling_params: Sampling = None, **inputs: Unpack[Inputs]
    ) -> Iterator[dict[str, Any]]:
        """Yield incremental chunks {index, text, output_ids, finish_reason[, usage]}.

        Closing the iterator early aborts the requests it still owns and frees their KV.
        """
        reqs, _ = self._submit(prompt, sampling_params, **inputs)
        reported = [0] * len(reqs)
        done = [False] * len(reqs)
        try:
            while not all(done):
                if not all(req.finished for req in reqs):
                    self._step()
                for index, req in enumerate(reqs):
                    if done[index]:
                        continue
                    chunk = self._chunk(index, req, reported[index])
                    if chunk is not None:
                        reported[index] = len(req.output_ids)
                        done[index] = req.finished
                        yield chunk
        finally:
            self._abort_unfinished(reqs)

    def build_request(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        detokenize: bool = True,
        output_ids: list[int] | None = None,
        field: str = "input_ids",
        pooling: str | None = None,
    ) -> Req:
        """A checked request, ready for `scheduler.add_request`; a FieldError names the field
        (`field`: what the prompt came as). The checks are the request normaliser's.

        With `detokenize` False the request gets a text stream only if it has stop strings
        (the worker stage leaves text to the detokenizer and only needs to find stops).
        `output_ids` resumes a request another worker began: those tokens count as output
        already generated (as after a retraction), and generation continues after them; a
        grammar's matcher consumes them, so the output goes on matching it. With `pooling` the
        request is an embedding (scheduling/pooling.py): it samples nothing, so only its ids
        and the prompt's fit are checked.
        """
        if pooling is None:
            check_request(input_ids, params, field, self.limits)
        else:
            check_token_ids(input_ids, field, self.vocab_size)
            check_fits(len(input_ids), 0, field, self.limits)
        if params.stop and self.tokenizer is None:
            raise FieldError("stop", "stop: stop strings need a tokenizer; this model has none")
        req = self._make_req(input_ids, params, rid, detokenize or bool(params.stop))
        req.matcher = self.grammars.matcher(params)
        req.pooling = pooling
        if output_ids:
            check_resumed_ids(output_ids, params, self.vocab_size)
            if req.matcher is not None and not req.matcher.consume_tokens(list(output_ids)):
                raise FieldError(
                    "output_ids", f"output_ids do not match the grammar: {req.matcher.get_error()}"
                )
            req.output_ids = list(output_ids)
            # Their logprobs were published by the worker that produced them.
            req.logprobs = [0.0] * len(output_ids)
            req.top_logprobs = [[] for _ in output_ids]
            req.prompt_logprobs = None  # and its prompt's, with its first tokens
            if req.text_stream is not None:
                req.text_stream.push(req.output_ids)  # a stop string may span the resume
        return req

    def sampling_params(
        self, sampling: Mapping[str, Any] | None, prompt_tokens: int, field: str = "input_ids"
    ) -> SamplingParams:
        """A prompt's parameters from a sampling map, with the normaliser's defaults: a
        missing ``max_new_tokens`` is all that fit the context and the KV pool."""
        return params_with_defaults(sampling, prompt_tokens, field, self.limits)

    def flush_cache(self) -> bool:
        """Drop the prefix cache and free its KV; refused (False) while requests are live."""
        return self.scheduler.flush_cache()

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort_request(rid) is not None

    def shutdown(self) -> None:
        for req in self.scheduler.live_requests():
            self.scheduler.abort_request(req.rid)
        self.runner.forward_hooks.remove()
        self.runner.close()  # the other tensor-parallel ranks, if any
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------

    def _submit(
        self,
        prompt: Prompts,
        sampling_params: Sampling,
        input_ids: TokenPrompts | None = None,
        messages: Sequence[Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        pooling: str | None = None,
    ) -> tuple[list[Req], bool]:
        prompts, single = split_prompts(prompt, messages, input_ids, tools, many=True)
        encoded = encode_prompts(prompts, self.tokenizer)
        maps = sampling_maps(sampling_params, len(prompts))
        # Every request is checked before any is queued.
        reqs = []
        for one, ids, sampling in zip(prompts, encoded, maps, strict=True):
            if isinstance(ids, ValueError):
                raise ids
            params = self.sampling_params(sampling, len(ids), one.field)
            rid = uuid.uuid4().hex
            reqs.append(self.build_request(rid, ids, params, field=one.field, pooling=pooling))
        for req in reqs:
            self.scheduler.add_request(req)
        return reqs, single

    def _make_req(
        self, ids: list[int], params: SamplingParams, rid: str, detokenize: bool = True
    ) -> Req:
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        text_stream = None
        if self.tokenizer is not None and detokenize:
            text_stream = TextStream(
                self.tokenizer, params.stop, params.skip_special_tokens, prompt_ids=ids
            )
        return Req(rid, ids, params, self.eos_ids, generator, text_stream)

    def _run(self, reqs: list[Req]) -> list[Req]:
        """Step until `reqs` are finished (those left unfinished by an error are aborted)."""
        try:
            while not all(req.finished for req in reqs):
                self._step()
        finally:
            self._abort_unfinished(reqs)
        return reqs

    def _step(self) -> None:
        if self.scheduler.step() is None:
            # Admission guarantees every request fits the pool alone, so an unfinished request
            # always has a batch to run; getting here is a scheduler bug, not a user error.
            raise RuntimeError(f"scheduler has nothing to run: {self.scheduler.load()}")

    def _abort_unfinished(self, reqs: list[Req]) -> None:
        for req in reqs:
            if not req.finished:
                self.scheduler.abort_request(req.rid)

    def _usage(self, req: Req) -> dict[str, int]:
        prompt_tokens = len(req.origin_input_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(req.output_ids),
            "total_tokens": prompt_tokens + len(req.output_ids),
            "cached_tokens": req.prompt_cache_hit or 0,
            **speculative_usage(req),
        }

    def _result(self, req: Req) -> dict[str, Any]:
        result: dict[str, Any] = {
            "rid": req.rid,
            "text": req.text_stream.text if req.text_stream is not None else None,
            "output_ids": list(req.output_ids),
            "finish_reason": req.finished_reason.kind,
            "matched_stop": req.finished_reason.matched,
            "usage": self._usage(req),
        }
        if req.params.logprobs:
            result["logprobs"] = list(req.logprobs)
            if req.params.top_logprobs:
                result["top_logprobs"] = list(req.top_logprobs)
        result.update(_prompt_logprobs(req))
        return result

    def _chunk(self, index: int, req: Req, reported: int) -> dict[str, Any] | None:
        new_ids = req.output_ids[reported:]
        if not new_ids and not req.pending_text and not req.finished:
            return None
        text = "".join(req.pending_text)
        req.pending_text.clear()
        chunk: dict[str, Any] = {
            "index": index,
            "rid": req.rid,
            "text": text if req.text_stream is not None else None,
            "output_ids": list(new_ids),
            "finish_reason": req.finished_reason.kind if req.finished else None,
        }
        if req.params.logprobs:
            chunk["logprobs"] = req.logprobs[reported:]
        if reported == 0:
            chunk.update(_prompt_logprobs(req))
        if req.finished:
            chunk["matched_stop"] = req.finished_reason.matched
            chunk["usage"] = self._usage(req)
        return chunk


def _prompt_logprobs(req: Req) -> dict[str, Any]:
    """The prompt's logprobs, in vLLM's shape: one entry per prompt token, None for the
    first (nothing comes before it to score it)."""
    if req.prompt_logprobs is None:
        return {}
    out: dict[str, Any] = {"prompt_logprobs": [None, *req.prompt_logprobs]}
    if req.params.top_logprobs:
        out["prompt_top_logprobs"] = [None, *req.prompt_top_logprobs]
    return out
