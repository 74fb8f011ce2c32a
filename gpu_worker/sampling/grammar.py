"""Grammar-constrained decoding: each request's llguidance matcher, and its token mask.

A request with a grammar (jobs/grammar.py) carries an `LLMatcher` that has consumed every
token of its output. Before each sampling step the matcher fills one row of a packed
bitmask (bit t of word t // 32 set: token t allowed); the sampler turns the rows into
-inf cells (`GrammarMask`: a C kernel on CPU, tensor ops elsewhere). EOS is allowed only
where the grammar accepts, and a matcher that is stopped (its grammar complete) ends the
request with "stop".

Compiling a grammar is the expensive part, so `Grammars` keeps one template matcher per
grammar string and gives each request a deep copy. llguidance's tokenizer is built once,
at the first grammar request, from the model's tokenizer.json (jobs/model_tokenizer.py),
which is what llguidance's own transformers adapter hands it.

A grammar is a client's text (a direct job reaches the worker unchecked), so compiling one
runs in jobs/grammar.py's compile pool, not on the engine thread's stack: whatever it raises
(RecursionError, MemoryError, llguidance's errors) or a compile past the deadline
(`STREAMSERVE_GRAMMAR_COMPILE_TIMEOUT_S`) is a FieldError naming the field, which the worker
answers with a 400 for that request alone. The worker never waits for a compile: it starts
it with `compile_soon` and parks the job (gpu_worker/grammar_waits.py) while the engine
steps the others; `matcher` then finds the template compiled. Called directly (the offline
Engine), `matcher` waits for the compile, at most the deadline.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.numpy import (
    allocate_token_bitmask,
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
)

from jobs.field_error import FieldError
from jobs.grammar import (
    CACHED_GRAMMARS,
    COMPILE_POOL,
    compile_grammar,
    grammar_field,
    too_slow,
)
from jobs.request_bounds import request_bounds
from jobs.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gpu_worker.kernels.cpu_kernels import CpuKernels
    from jobs.model_tokenizer import ModelTokenizer


# From this many grammar rows a step, llguidance's threads fill the masks; below, handing
# the work to them costs more than it saves.
PARALLEL_FILL_ROWS = 8


class Grammars:
    """Matchers for one model's vocabulary."""

    def __init__(
        self, tokenizer: ModelTokenizer | Any | None, vocab_size: int, eos_ids: Iterable[int]
    ) -> None:
        self.tokenizer = tokenizer  # None for models without one (random: shapes)
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: LLTokenizer | None = None
        self._templates: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        # Compiles started by `compile_soon`, by (field, spec), until `matcher` takes them.
        self._compiling: dict[tuple[str, str], concurrent.futures.Future] = {}

    def compile_soon(self, params: SamplingParams) -> tuple[str, concurrent.futures.Future] | None:
        """Start compiling the request's grammar in the pool where it is not compiled yet:
        (its field, the compile's future), for a caller that waits off its engine thread
        (gpu_worker/grammar_waits.py); None when `matcher` would not wait."""
        field = grammar_field(vars(params))
        if field is None or self.tokenizer is None:
            return None
        key = (field, getattr(params, field))
        if key in self._templates:
            return None
        future = self._compiling.get(key)
        if future is None:
            future = COMPILE_POOL.submit(_template, self._llg_tokenizer(), *key)
            self._compiling[key] = future
        return None if future.done() else (field, future)

    def matcher(self, params: SamplingParams) -> LLMatcher | None:
        """A fresh matcher for the request's grammar, None when it has none; FieldError when
        it is too big or deep, does not compile in time, or this model cannot serve it."""
        field = grammar_field(vars(params))
        if field is None:
            return None
        if self.tokenizer is None:
            raise FieldError(field, f"{field}: this model has no tokenizer to match a grammar with")
        spec = getattr(params, field)
        template = self._templates.get((field, spec))
        if template is None:
            tokenizer = self._llg_tokenizer()  # the model's own: built here, once
            deadline = request_bounds().grammar_compile_timeout_s
            future = self._compiling.pop((field, spec), None)
            if future is None:
                future = COMPILE_POOL.submit(_template, tokenizer, field, spec)
            try:
                template = future.result(timeout=deadline)
            except concurrent.futures.TimeoutError:
                raise FieldError(field, too_slow(field, deadline)) from None
            self._templates[(field, spec)] = template
            if len(self._templates) > CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end((field, spec))
        matcher = template.deep_copy()
        # Its first mask (tens of µs): an earlier request's states may have taken the lexer
        # its copies share past llguidance's limits, and then every copy masks all but
        # end-of-sequence. Such a grammar is refused (and compiled afresh next time).
        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            del self._templates[(field, spec)]
            raise FieldError(field, f"{field} cannot be matched: {first_line(matcher.get_error())}")
        return matcher

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            assert self.tokenizer is not None  # the callers refuse a grammar without one
            self._tokenizer = LLTokenizer(
                _vocabulary_json(self.tokenizer), n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        return self._tokenizer


def _vocabulary_json(tokenizer: Any) -> str:
    """tokenizer.json as `tokenizer` reads it: a ModelTokenizer's, or that of a transformers
    fast tokenizer handed in by a caller (what llguidance's own adapter reads)."""
    if hasattr(tokenizer, "vocabulary_json"):
        return tokenizer.vocabulary_json()
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _template(tokenizer: LLTokenizer, field: str, spec: str) -> LLMatcher:
    """The compiled matcher for `spec` (run in the compile pool); FieldError naming `field`."""
    grammar = compile_grammar(field, spec)
    try:
        template = LLMatcher(tokenizer, grammar)
    except Exception as exc:  # a client's grammar: whatever llguidance raises is its problem
        raise FieldError(field, f"{field} does not compile: {type(exc).__name__}: {exc}") from None
    if template.is_error():
        raise FieldError(field, f"{field}: {template.get_error()}")
    # The first mask here, in the pool, not in an engine step that every request waits on
    # (a grammar's first mask can take a second); its lexer states stay for the copies.
    probe = template.deep_copy()
    fill_next_token_bitmask(probe, allocate_token_bitmask(1, tokenizer.vocab_size), 0)
    if probe.is_error():
        raise FieldError(field, f"{field} cannot be matched: {first_line(probe.get_error())}")
    return template


@dataclass
class GrammarMask:
    """The tokens each grammar row may take next; rows without a grammar are not touched."""

    rows: torch.Tensor  # [n] int64, on the logits' device: the rows that have a matcher
    bitmask: torch.Tensor  # [n, ceil(vocab / 32)] int32, on the logits' device

    @classmethod
    def build(
        cls,
        matchers: list[LLMatcher | None],
        vocab_size: int,
        device,
        drafts_before: list[list[int]] | None = None,
    ) -> GrammarMask | None:
        """The mask of each row with a matcher. A row with `drafts_before` (a verify step's:
        the drafts it follows, which the grammar took when drafted) is masked in the state
        after them: the matcher consumes them for the row and rolls back after the batch.
        A request's rows come in draft order, each one draft further."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        bitmask = allocate_token_bitmask(len(rows), vocab_size)
        plain = not drafts_before or not any(drafts_before[row] for row in rows)
        if plain and len(rows) >= PARALLEL_FILL_ROWS:
            # One call for the batch: llguidance fills the rows on its own threads.
            targets = [(matchers[row], i) for i, row in enumerate(rows)]
            fill_next_token_bitmask_par(_executor(), targets, bitmask)
            return cls(_index(rows, device), torch.from_numpy(bitmask).to(device))
        # id(matcher) -> [it, drafts seen, drafts consumed]
        ahead: dict[int, list] = {}
        try:
            for i, row in enumerate(rows):
                matcher = matchers[row]
                drafts = drafts_before[row] if drafts_before else []
                state = ahead.setdefault(id(matcher), [matcher, 0, 0])
                for token in drafts[state[1] :]:
                    state[1] += 1
                    if matcher.is_stopped():
                        break  # a draft past the grammar's end: refused below
                    if not matcher.consume_token(token):
                        raise RuntimeError(f"a draft the grammar refuses: {matcher.get_error()}")
                    state[2] += 1
                if state[2] < len(drafts):
                    # The request ends with its grammar, before this row: any mask will do.
                    bitmask[i] = -1
                    continue
                fill_next_token_bitmask(matcher, bitmask, i)
        finally:
            for matcher, _, consumed in ahead.values():
                if consumed:
                    matcher.rollback(consumed)
        return cls(_index(rows, device), torch.from_numpy(bitmask).to(device))

    def apply(self, logits: torch.Tensor, cpu_kernels: CpuKernels | None = None) -> None:
        """Set the disallowed cells of `logits` ([bs, vocab] float32) to -inf, in place."""
        if cpu_kernels is not None and logits.device.type == "cpu":
            cpu_kernels.apply_token_bitmask(logits, self.rows, self.bitmask)
            return
        vocab = logits.shape[-1]
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        bits = (self.bitmask.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
        allowed = bits.flatten(1)[:, :vocab].bool()
        logits[self.rows] = logits[self.rows].masked_fill_(~allowed, float("-inf"))


@functools.cache
def _executor() -> LLExecutor:
    return LLExecutor()


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def consume(matcher: LLMatcher, token: int) -> str | None:
    """Advance `matcher` by the token the request emitted; why it cannot, or None. A matcher
    in error (its grammar outgrew llguidance's limits) masks all but end-of-sequence and
    takes it: that is its error too, not the grammar's end."""
    if matcher.consume_token(token) and not matcher.is_error():
        return None
    return first_line(matcher.get_error()) or f"token {token} is not allowed by the grammar"


def first_line(error: str) -> str:
    """llguidance's error without the parser state it appends on later lines."""
    return error.strip().split("\n", 1)[0]
