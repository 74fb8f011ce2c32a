"""SamplingParams: what one request asks of the sampler and of the stop checks (and its
scheduling class, `priority`, which travels beside them: see below).

The dataclass is the one table of sampling parameters. Each field's metadata is a `Param`:
its JSON types and how a value is type-checked (`Kind`), its range check (both in
jobs/sampling_checks.py), its names in an OpenAI request and a line for the OpenAPI
description. `SAMPLING_FIELDS` lists those rows in field order; the ingress's field checks,
its OpenAI mapping and its OpenAPI schema are read off it, so no other list of the
parameters is kept in step with this one.

A request's parameters are checked where it enters the system: `wire_sampling` (the ingress
and the direct Redis client) builds and checks the parameters from a client's map, and writes
the job's wire form from them (`SamplingParams.to_wire`: the fields the client gave, each
normalised). The worker turns that map back into parameters with `SamplingParams.from_wire`
and checks them against its model; as a job written straight to Redis reaches it unchecked,
the worker's `validate` is the bus's one full check (its cost: tens of microseconds a job).

`priority` is a row of the table so that requests (HTTP, `Engine.generate`) give and check it
like the rest, but on the wire it is a job field beside ``sampling`` (jobs/requests.py):
the ingress and the client lift it out, and the worker sets the job's on its request.

Types are checked and normalised on construction (a single stop string becomes a list, JSON
string keys of logit_bias become ints); ranges are checked by `validate`, which needs the
model's vocabulary size. Every mistake is a SamplingParamError carrying its field.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from jobs.grammar import compile_with_deadline, grammar_field
from jobs.protocol import MAX_TOKEN_ID
from jobs.sampling_checks import (
    BOOLEAN,
    GRAMMAR_TEXT,
    INTEGER,
    JSON_SCHEMA,
    NUMBER,
    OPTIONAL_INTEGER,
    STOP_STRINGS,
    TOKEN_BIASES,
    TOKEN_IDS,
    Check,
    Kind,
    SamplingParamError,
    check_grammar,
    check_logit_bias,
    check_max_new_tokens,
    check_min_new_tokens,
    check_min_p,
    check_openai_penalty,
    check_priority,
    check_repetition_penalty,
    check_seed,
    check_stop,
    check_stop_token_ids,
    check_temperature,
    check_top_k,
    check_top_logprobs,
    check_top_p,
)

# Below this a temperature is treated as greedy: dividing logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what msgpack carries


@dataclass(frozen=True)
class Param:
    """One row of the table: what a SamplingParams field declares besides its Python type."""

    kind: Kind
    doc: str  # one line, for the OpenAPI description
    check: Check | None  # its range check, run by `validate`
    openai: tuple[str, ...] | None = None  # its names in OpenAI requests; None: its own name
    off_value: int | None = None  # a value the HTTP APIs take as null (top_k: -1, as vLLM, SGLang)
    name: str = ""  # filled in from the dataclass field


def _param(default: Any, kind: Kind, check: Check | None, doc: str, **openai: Any) -> Any:
    """A SamplingParams field with its row of the table; a list or dict default is copied."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(
            default_factory=default.copy, metadata={"param": Param(kind, doc, check, **openai)}
        )
    return dataclasses.field(default=default, metadata={"param": Param(kind, doc, check, **openai)})


@dataclass
class SamplingParams:
    max_new_tokens: int = _param(
        128, INTEGER, check_max_new_tokens, "the most tokens to generate (absent: all that fit)",
        openai=("max_tokens", "max_completion_tokens"),
    )  # fmt: skip
    min_new_tokens: int = _param(
        0, INTEGER, check_min_new_tokens, "the fewest tokens to generate: stops and EOS wait",
        openai=("min_tokens",),
    )  # fmt: skip
    temperature: float = _param(1.0, NUMBER, check_temperature, "0 is greedy; higher is flatter")
    top_p: float = _param(
        1.0, NUMBER, check_top_p, "sample from the likeliest tokens that make up this probability"
    )
    top_k: int | None = _param(
        None, OPTIONAL_INTEGER, check_top_k, "sample from the k likeliest tokens; null: all",
        off_value=-1,
    )  # fmt: skip
    min_p: float = _param(
        0.0, NUMBER, check_min_p, "drop tokens less likely than min_p x the likeliest"
    )
    # HF semantics, over prompt + output tokens: positive logits / p, negative logits * p.
    repetition_penalty: float = _param(
        1.0, NUMBER, check_repetition_penalty, "above 1 discourages the tokens of prompt and output"
    )
    # OpenAI semantics, over output tokens only: logit -= count * freq + (count > 0) * presence.
    frequency_penalty: float = _param(
        0.0, NUMBER, check_openai_penalty, "subtracted from a logit per time its token was output"
    )
    presence_penalty: float = _param(
        0.0, NUMBER, check_openai_penalty, "subtracted once from the logit of each token output"
    )
    seed: int | None = _param(None, OPTIONAL_INTEGER, check_seed, "makes sampling repeatable")
    stop: list[str] = _param([], STOP_STRINGS, check_stop, "strings that end the output")
    stop_token_ids: list[int] = _param(
        [], TOKEN_IDS, check_stop_token_ids, "token ids that end the output"
    )
    ignore_eos: bool = _param(False, BOOLEAN, None, "go on past the end-of-sequence token")
    logit_bias: dict[int, float] = _param(
        {}, TOKEN_BIASES, check_logit_bias, "token id (as a string) -> bias added to its logit"
    )
    # Not OpenAI parameters as they are: parse_chat and parse_completion map their logprobs.
    logprobs: bool = _param(False, BOOLEAN, None, "return each token's log probability", openai=())
    top_logprobs: int = _param(
        0, INTEGER, check_top_logprobs, "with logprobs: how many alternatives per token",
        openai=(),
    )  # fmt: skip
    skip_special_tokens: bool = _param(True, BOOLEAN, None, "leave special tokens out of the text")
    # Logits at every prompt position: no prefix-cache hit serves the positions still wanted.
    prompt_logprobs: bool = _param(
        False, BOOLEAN, None, "return each prompt token's log probability (top_logprobs "
        "alternatives too); max_new_tokens may then be 0", openai=(),
    )  # fmt: skip
    # Structured output (jobs/grammar.py), one at most; OpenAI's response_format maps to the first.
    json_schema: str | None = _param(
        None, JSON_SCHEMA, check_grammar, "a JSON Schema the output must match", openai=()
    )
    regex: str | None = _param(
        None, GRAMMAR_TEXT, check_grammar, "a regular expression the output must match",
        openai=(),
    )  # fmt: skip
    ebnf: str | None = _param(
        None, GRAMMAR_TEXT, check_grammar, "a grammar the output must match: GBNF or Lark",
        openai=(),
    )  # fmt: skip

    # The scheduler's, not the sampler's: here so a request gives and checks it like the rest;
    # on the wire it is the job's field (jobs/requests.py).
    priority: int = _param(
        0, INTEGER, check_priority, "scheduling class, vLLM's convention: lower is served "
        "first and retracted last; requests default to 0, batch lines run at 1 or above",
    )  # fmt: skip

    def __post_init__(self) -> None:
        for param in SAMPLING_FIELDS:
            setattr(self, param.name, param.kind.parse(param.name, getattr(self, param.name)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise SamplingParamError(
                "sampling_params", f"sampling_params must be a dict, got {type(d).__name__}"
            )
        for key in d:
            if key not in FIELD_NAMES:
                raise SamplingParamError(str(key), f"unknown sampling parameter {key!r}")
        return cls(**d)

    @classmethod
    def from_wire(cls, sampling: Mapping[str, Any], default_max_new_tokens: int) -> SamplingParams:
        """A job's sampling map (see `wire_sampling`) as parameters, before `validate`.

        `default_max_new_tokens` applies where the client gave none: a worker passes what
        the context leaves after the prompt.
        """
        return cls.from_dict({"max_new_tokens": default_max_new_tokens, **sampling})

    def to_wire(self, names: Iterable[str]) -> dict[str, Any]:
        """The fields `names` in their wire form, for msgpack: logit_bias keyed by strings
        (msgpack map keys must be strings for the readers: strict_map_key); the rest are
        in normal form already (a stop list, a schema's JSON text, floats)."""
        wire = {name: getattr(self, name) for name in names}
        if "logit_bias" in wire:
            wire["logit_bias"] = {str(token): bias for token, bias in self.logit_bias.items()}
        return wire

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise SamplingParamError for the first value out of its range."""
        for param in SAMPLING_FIELDS:
            if param.check is not None:
                problem = param.check(param.name, getattr(self, param.name), vars(self), vocab_size)
                if problem is not None:
                    raise SamplingParamError(param.name, problem)


def _rows() -> tuple[Param, ...]:
    rows = []
    for f in fields(SamplingParams):
        param = f.metadata["param"]
        openai = (f.name,) if param.openai is None else param.openai
        rows.append(dataclasses.replace(param, name=f.name, openai=openai))
    return tuple(rows)


SAMPLING_FIELDS: tuple[Param, ...] = _rows()
FIELD_NAMES = frozenset(param.name for param in SAMPLING_FIELDS)


def wire_sampling(
    sampling: Mapping[str, Any] | None, compile_grammar: bool = True
) -> dict[str, Any]:
    """`sampling` checked as SamplingParams (SamplingParamError), and its wire form written
    from them (`SamplingParams.to_wire`).

    Only the fields given are sent, so the worker's defaults apply to the rest; a missing
    ``max_new_tokens`` means "up to the context length". Checks that need the model's
    vocabulary are left to the worker. A grammar is compiled (in jobs/grammar.py's pool,
    waited for up to its deadline; GrammarError, a FieldError too, if it cannot be) unless
    `compile_grammar` is False: the ingress compiles it itself, off its event loop
    (`compile_async`). A given ``priority`` stays in the map: the job's builder lifts it
    beside ``sampling`` (jobs/requests.py's `lift_priority`).
    """
    given = dict(sampling or {})
    key = _scalar_key(given)
    if key is None:
        wire, grammar = _checked_wire(given)
    else:
        wire, grammar = _checked_wire_cached(key)
        # Copies of its lists and maps (a stop string becomes a list): the caller's own.
        wire = {name: _copied(value) for name, value in wire.items()}
    if compile_grammar and grammar is not None:
        compile_with_deadline(*grammar)
    return wire


def _checked_wire(given: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, Any] | None]:
    """`wire_sampling`'s checks and wire form, and the grammar to compile (its field and
    value) if one was given."""
    params = SamplingParams.from_dict(given)
    for name, value in given.items():
        # SamplingParams bounds few integers above; msgpack carries only 64 bits.
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise SamplingParamError(name, f"{name} is out of range: {value}")
    wire = params.to_wire(given)
    if "max_new_tokens" not in given:
        params.max_new_tokens = MAX_TOKEN_ID  # the context length bounds it downstream
    params.validate(vocab_size=MAX_TOKEN_ID)
    grammar = grammar_field(vars(params))
    return wire, None if grammar is None else (grammar, getattr(params, grammar))


# Most requests give a few scalars, and many the same ones: their checks and wire form are
# kept (15 of the ~25 us an OpenAI request's parameters cost the ingress). A map holding a
# list or a map (stop strings, logit_bias, a schema) or a long string (a grammar) is checked
# each time: what the cache holds stays small whatever clients send (1,024 short keys).
_SCALARS = frozenset({int, float, bool, type(None)})
_CACHED_STR_CHARS = 64


def _scalar_key(given: dict[str, Any]) -> tuple | None:
    for value in given.values():
        if type(value) not in _SCALARS and not (
            type(value) is str and len(value) <= _CACHED_STR_CHARS
        ):
            return None
    # Each value's type is in the key: True == 1 and 1 == 1.0, but they check differently.
    return tuple((name, type(value), value) for name, value in given.items())


def _copied(value: Any) -> Any:
    return value.copy() if isinstance(value, (list, dict)) else value


@functools.lru_cache(maxsize=1024)
def _checked_wire_cached(key: tuple) -> tuple[dict[str, Any], tuple[str, Any] | None]:
    return _checked_wire({name: value for name, _, value in key})
