"""A synthetic engine: no model, no torch. Tokens at a set rate, for load tests of the bus.

    python -m gpu_worker --synthetic --synthetic-step-ms 10 --synthetic-batch 64 \
        --model smollm2-135m-instruct

Never the default: only ``--synthetic`` starts it, and its heartbeat and logs say
"synthetic engine: no model". The worker stage (gpu_worker/worker.py) runs it in place of
`Engine`, through the same seam (a scheduler, a runner's figures, `sampling_params`,
`build_request`), so everything around the engine is the real thing: the worker's bus
traffic, the router, the detokenizer, the ingress. What a benchmark of those measures
(benchmarks/bench_bus_load.py) is then theirs, not a model's.

Each step gives one token to each of up to `batch` running requests and lasts `step_ms`
(the step sleeps what its bookkeeping left of it), so a busy worker makes about
``batch * 1000 / step_ms`` tokens/s. A request admitted in a step gets its first token in
that step (no prefill cost). A token is a function of the request id and its output
position only, inside the model's vocabulary and clear of its special tokens, so a job
that migrates to another worker continues the same sequence and the detokenizer decodes
real (if meaningless) text.

Requests are real `Req`s and end as the real scheduler ends them (scheduling/outputs.py):
"length" at max_new_tokens or the context, "stop" on a stop token id (past min_tokens),
"abort" when aborted. Logprobs asked for are 0.0. What the engine cannot honour without a
model (stop strings, which need the detokenizer's text; grammars) is refused as the
request's error, naming the field. Sampling settings (temperature, penalties, bias, seed)
are accepted and have no effect.

The model argument names the vocabulary, the context length and the end-of-sequence ids,
read from its files without loading it (a GGUF header, or a folder's config.json), and
what the worker says it serves.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from gpu_worker.model_executor.forward_mode import ForwardMode
from gpu_worker.scheduling.req import FinishReason, Req
from jobs.field_error import FieldError
from jobs.grammar import grammar_field
from jobs.request_normaliser import ModelLimits, check_request, check_resumed_ids
from jobs.request_normaliser import sampling_params as params_with_defaults
from jobs.sampling_params import SamplingParams
from runtime.gguf_header import gguf_metadata
from runtime.model_files import resolve_model

logger = logging.getLogger(__name__)

SERVING_PATH = "synthetic engine: no model"
NO_MODEL = "synthetic engine (no model)"
DEFAULT_STEP_MS = 10.0
DEFAULT_BATCH = 64


@dataclass(frozen=True)
class ModelFacts:
    """What the synthetic engine needs of a model, read from its files."""

    vocab_size: int
    context_length: int
    eos_ids: frozenset[int]


def model_facts(model: str) -> ModelFacts:
    """The vocabulary size, context length and end-of-sequence ids of `model`, without
    loading it; ValueError when its files do not say (or it is a random: shape, which has
    no tokenizer to decode synthetic tokens with)."""
    resolved = resolve_model(model, marker="config.json", what="model")
    if resolved.kind == "random" or resolved.path is None:
        raise ValueError(f"the synthetic engine needs a model with a vocabulary, not {model!r}")
    if resolved.kind == "gguf":
        with open(resolved.path, "rb") as file:
            meta = dict(gguf_metadata(file))
        arch = meta.get("general.architecture")
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = meta.get(f"{arch}.vocab_size") or getattr(tokens, "length", None)
        context = meta.get(f"{arch}.context_length")
        eos = meta.get("tokenizer.ggml.eos_token_id")
    else:
        values = json.loads((Path(resolved.path) / "config.json").read_text(encoding="utf-8"))
        values = {**values.get("text_config", {}), **values}
        vocab, context = values.get("vocab_size"), values.get("max_position_embeddings")
        eos = values.get("eos_token_id")
    if not isinstance(vocab, int) or not isinstance(context, int):
        raise ValueError(f"{model}: its files give no vocabulary size or context length")
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return ModelFacts(vocab, context, frozenset(int(i) for i in eos_ids))


def synthetic_token(rid: str, position: int, facts: ModelFacts) -> int:
    """The token at output `position` of request `rid`: the same on every worker. Drawn from
    the middle of the vocabulary, where BPE vocabularies keep ordinary tokens (special and
    added tokens sit at either end), and never an end-of-sequence id."""
    low, high = facts.vocab_size // 8, max(facts.vocab_size // 2, facts.vocab_size // 8 + 1)
    token = low + (_rid_seed(rid) + position * 7919) % (high - low)
    while token in facts.eos_ids:
        token = low + (token + 1 - low) % (high - low)
    return token


@lru_cache(maxsize=8192)
def _rid_seed(rid: str) -> int:
    # Once per request, not once per token: the stand-in's own CPU counts as the worker's
    # in benchmarks/bench_bus_load.py, which measures the bus.
    return zlib.crc32(rid.encode())


class SyntheticRunner:
    """The figures the worker reads off `engine.runner`: a notional KV pool of one full
    context per batch slot (what the router and the heartbeat see), and no weights."""

    attention_path = SERVING_PATH
    graph_runner = None
    cpu_kernels = None
    dtype = "no weights"
    device = SERVING_PATH

    def __init__(self, facts: ModelFacts, batch: int) -> None:
        self.context_length = facts.context_length
        self.max_total_tokens = facts.context_length * batch

    def serving_path(self) -> str:
        return SERVING_PATH


class SyntheticScheduler:
    """The scheduler's interface as the worker uses it, stepping by the clock."""

    def __init__(self, facts: ModelFacts, runner: SyntheticRunner, step_ms: float, batch: int):
        self.facts = facts
        self.runner = runner
        self.step_s = step_ms / 1000
        self.batch = batch
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0  # nothing is ever retracted: there is no KV to run out of
        self.last_mode: ForwardMode | None = None
        self.stepping: list[str] | None = None
        # `load` until the next change: the worker reads it every turn, and summing every
        # live request's tokens each time was a tenth of the stand-in's CPU.
        self._load: dict[str, int] | None = None

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)
        self._load = None

    def abort_request(self, rid: str) -> Req | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._load = None
                    req.finished_reason = FinishReason("abort", "aborted by the client")
                    return req
        return None

    def live_requests(self) -> list[Req]:
        return [*self.waiting, *self.running]

    def reset(self) -> None:
        self.waiting.clear()
        self.running.clear()
        self._load = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> dict[str, int]:
        if self._load is None:
            free = self.runner.max_total_tokens - sum(r.num_tokens for r in self.live_requests())
            self._load = {"waiting": len(self.waiting), "running": len(self.running),
                          "free_kv_tokens": max(0, free)}  # fmt: skip
        return dict(self._load)

    def step(self) -> list[Req] | None:
        """One token for each running request (up to `batch`, the oldest waiting admitted
        first); None when nothing is live. Takes `step_ms` in all."""
        started = time.perf_counter()
        self.stepping = None
        self._load = None
        admitted = False
        while self.waiting and len(self.running) < self.batch:
            req = self.waiting.popleft()
            _admitted(req)
            self.running.append(req)
            admitted = True
        if not self.running:
            return None
        self.stepping = [req.rid for req in self.running]
        self.last_mode = ForwardMode.EXTEND if admitted else ForwardMode.DECODE
        sampled = self.running
        for req in sampled:
            self._append(req)
        self.running = [req for req in sampled if not req.finished]
        left = self.step_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        return sampled

    def _append(self, req: Req) -> None:
        """As scheduling/outputs.py's append_token, for the stops a synthetic token can meet."""
        if req.params.max_new_tokens == 0:  # only its prompt's logprobs were asked for
            req.finished_reason = FinishReason("length")
            return
        token = synthetic_token(req.rid, len(req.output_ids), self.facts)
        req.output_ids.append(token)
        if req.params.logprobs:
            req.logprobs.append(0.0)
            if req.params.top_logprobs:
                req.top_logprobs.append([(token, 0.0)])
        num_out = len(req.output_ids)
        if token in req.stop_ids and num_out >= req.params.min_new_tokens:
            req.finished_reason = FinishReason("stop", token)
        elif num_out >= req.params.max_new_tokens or req.num_tokens >= self.facts.context_length:
            req.finished_reason = FinishReason("length")


def _admitted(req: Req) -> None:
    """What a prefill would have recorded: no cache hit, and zero prompt logprobs."""
    if req.prompt_cache_hit is None:
        req.prompt_cache_hit = 0
    if req.prompt_logprobs is not None and not req.prompt_logprobs:
        prompt = req.origin_input_ids
        req.prompt_logprobs = [0.0] * (len(prompt) - 1)
        if req.params.top_logprobs:
            req.prompt_top_logprobs = [[(token, 0.0)] for token in prompt[1:]]


class _NoGrammars:
    """Nothing to compile: `build_request` refuses a grammar."""

    def compile_soon(self, params: SamplingParams) -> None:
        return None


@dataclass(frozen=True)
class SyntheticConfig:
    model: str
    step_ms: float
    batch: int


class SyntheticEngine:
    """What gpu_worker/worker.py's Worker reads of an `Engine`, with no model behind it."""

    def __init__(
        self, model: str, step_ms: float = DEFAULT_STEP_MS, batch: int = DEFAULT_BATCH
    ) -> None:
        if step_ms <= 0 or batch < 1:
            raise ValueError("--synthetic-step-ms must be > 0 and --synthetic-batch >= 1")
        self.config = SyntheticConfig(model, step_ms, batch)
        self.facts = model_facts(model)
        self.vocab_size = self.facts.vocab_size
        self.eos_ids = self.facts.eos_ids
        self.tokenizer = None
        self.runner = SyntheticRunner(self.facts, batch)
        self.scheduler = SyntheticScheduler(self.facts, self.runner, step_ms, batch)
        self.grammars = _NoGrammars()
        self.limits = ModelLimits(self.vocab_size, self.facts.context_length,
                                  self.runner.max_total_tokens)  # fmt: skip
        logger.info("%s: %s's vocabulary (%d), up to %d requests a step of %.1f ms "
                    "(about %.0f tokens/s at full batch)", SERVING_PATH, model,
                    self.vocab_size, batch, step_ms, batch * 1000 / step_ms)  # fmt: skip

    def sampling_params(
        self, sampling: Mapping[str, Any] | None, prompt_tokens: int, field: str = "input_ids"
    ) -> SamplingParams:
        return params_with_defaults(sampling, prompt_tokens, field, self.limits)

    def build_request(
        self, rid: str, input_ids: list[int], params: SamplingParams, detokenize: bool = True,
        output_ids: list[int] | None = None, field: str = "input_ids", pooling: str | None = None,
    ) -> Req:  # fmt: skip
        """A checked request, as `Engine.build_request` makes it (the normaliser's checks),
        refusing what a synthetic engine cannot honour."""
        if pooling is not None:
            raise FieldError("pooling", f"pooling: this worker runs the {NO_MODEL}: no embeddings")
        check_request(input_ids, params, field, self.limits)
        grammar = grammar_field(vars(params))
        if grammar is not None:
            raise FieldError(grammar, f"{grammar}: this worker runs the {NO_MODEL}: no grammars")
        if params.stop:
            raise FieldError("stop", f"stop: this worker runs the {NO_MODEL}: no stop strings")
        # A bias is checked (above) but has nothing to bias; dropped, so no torch is loaded.
        req = Req(rid, input_ids, replace(params, logit_bias={}), self.eos_ids)
        if output_ids:
            check_resumed_ids(output_ids, params, self.vocab_size)
            req.output_ids = list(output_ids)
            req.logprobs = [0.0] * len(output_ids)
            req.top_logprobs = [[] for _ in output_ids]
            req.prompt_logprobs = None  # published with its first tokens, elsewhere
        return req


def add_synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags for this engine (gpu_worker/cli.py)."""
    group = parser.add_argument_group(
        "synthetic engine", "no model: tokens at a set rate, for load tests of the bus"
    )
    group.add_argument(
        "--synthetic", action="store_true", help="run it instead of the model (never the default)"
    )
    step_help = f"milliseconds one step takes (default {DEFAULT_STEP_MS:g})"
    group.add_argument("--synthetic-step-ms", type=float, default=None, help=step_help)
    batch_help = f"the most requests a step gives a token (default {DEFAULT_BATCH})"
    group.add_argument("--synthetic-batch", type=int, default=None, help=batch_help)


def synthetic_engine_from(args: argparse.Namespace) -> SyntheticEngine | None:
    """The engine those flags ask for; None without ``--synthetic``, and a ValueError for
    its settings without it (they would be ignored, and the model served unasked)."""
    step_ms, batch = args.synthetic_step_ms, args.synthetic_batch
    if not args.synthetic:
        if step_ms is not None or batch is not None:
            raise ValueError("--synthetic-step-ms and --synthetic-batch need --synthetic")
        return None
    step_ms = DEFAULT_STEP_MS if step_ms is None else step_ms
    return SyntheticEngine(args.model, step_ms, DEFAULT_BATCH if batch is None else batch)
