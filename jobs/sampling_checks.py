"""The checks behind the sampling-parameter table (jobs/sampling_params.py).

A `Kind` type-checks and normalises a value on construction; a range check (`Check`) runs
in `SamplingParams.validate`, where the model's vocabulary size is known, and returns the
problem in words or None. The messages start with the field they are about.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jobs.field_error import FieldError
from jobs.grammar import GRAMMAR_FIELDS, json_schema_text, shape_problem
from jobs.request_bounds import request_bounds

MAX_TOP_LOGPROBS = 20  # OpenAI's
MAX_LOGIT_BIAS = 100.0
# OpenAI's range for frequency_penalty and presence_penalty.
MAX_OPENAI_PENALTY = 2.0
SEED_LIMIT = 2**63


class SamplingParamError(FieldError):
    """A sampling parameter of the wrong type or out of its range; `field` names it."""


# (field name, value, every field's value by name, vocabulary size) -> the problem, or None.
Check = Callable[[str, Any, Mapping[str, Any], int], "str | None"]


@dataclass(frozen=True)
class Kind:
    """How a parameter travels in JSON, and how a Python value of it is checked."""

    json: tuple[str, ...]  # the JSON Schema types a request may give it as (null: not given)
    parse: Callable[[str, Any], Any]  # (name, value) -> its normal form, or SamplingParamError
    schema: Mapping[str, Any] = field(default_factory=dict)  # JSON Schema beyond the types


# ---- types ---------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """`value` quoted in a message; a huge one cut, so the error stays small."""
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _as_int(name: str, value: Any) -> int:
    # bool is an int subclass; `true` for a count is a client bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamError(name, f"{name} must be an integer, got {_shown(value)}")
    return value


def _as_optional_int(name: str, value: Any) -> int | None:
    return None if value is None else _as_int(name, value)


def _as_float(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SamplingParamError(name, f"{name} must be a number, got {_shown(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer past any float; too long to quote
        raise SamplingParamError(name, f"{name}: a number is out of range") from None


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamError(name, f"{name} must be true or false, got {_shown(value)}")
    return value


def _as_stop_list(name: str, stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        message = f"{name} must be a string or a list of strings, got {_shown(stop)}"
        raise SamplingParamError(name, message)
    return list(stop)


def _as_token_ids(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise SamplingParamError(name, f"{name} must be a list of token ids, got {_shown(ids)}")
    return [_as_int(name, token) for token in ids]


def _as_logit_bias(name: str, bias: Any) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise SamplingParamError(
            name, f"{name} must be a dict of token id -> bias, got {_shown(bias)}"
        )
    result: dict[int, float] = {}
    for key, value in bias.items():
        # JSON object keys are strings: {"50256": -100} means token 50256. No token id has
        # more digits than an int64 (and int() refuses strings of thousands of them).
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,19}", key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise SamplingParamError(name, f"{name}: key {_shown(key)} is not a token id")
        result[token] = _as_float(name, value)
    return result


def _as_optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise SamplingParamError(name, f"{name} must be a string, got {_shown(value)}")
    return value


def _as_grammar_text(name: str, value: Any) -> str | None:
    text = _as_optional_str(name, value)
    problem = None if text is None else shape_problem(name, text)
    if problem is not None:
        raise SamplingParamError(name, problem)
    return text


def _as_json_schema(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, (str, dict)):
        raise SamplingParamError(name, f"{name} must be a JSON Schema object, got {_shown(value)}")
    try:
        return json_schema_text(value)
    except ValueError as exc:
        raise SamplingParamError(name, f"{name} {exc}") from None


INTEGER = Kind(("integer",), _as_int)
OPTIONAL_INTEGER = Kind(("integer",), _as_optional_int)
NUMBER = Kind(("number",), _as_float)
BOOLEAN = Kind(("boolean",), _as_bool)
STOP_STRINGS = Kind(("string", "array"), _as_stop_list, {"items": {"type": "string"}})
TOKEN_IDS = Kind(("array",), _as_token_ids, {"items": {"type": "integer"}})
TOKEN_BIASES = Kind(("object",), _as_logit_bias, {"additionalProperties": {"type": "number"}})
OPTIONAL_STRING = Kind(("string",), _as_optional_str)
JSON_SCHEMA = Kind(("object", "string"), _as_json_schema)
GRAMMAR_TEXT = Kind(("string",), _as_grammar_text)


# ---- ranges --------------------------------------------------------------------------------
# Written as `not (lo <= x <= hi)` so that NaN fails too.


def check_max_new_tokens(name: str, value: int, values: Mapping[str, Any], _: int) -> str | None:
    if value >= 1 or (value == 0 and values.get("prompt_logprobs")):
        return None  # 0: the prompt's logprobs only, as lm-evaluation-harness asks
    return f"{name} must be at least 1 (0 only with prompt logprobs), got {value}"


def check_min_new_tokens(name: str, value: int, values: Mapping[str, Any], _: int) -> str | None:
    if 0 <= value <= values["max_new_tokens"]:
        return None
    return f"{name} must be in [0, max_new_tokens={values['max_new_tokens']}], got {value}"


def check_temperature(name: str, value: float, *_: Any) -> str | None:
    return None if 0.0 <= value < math.inf else f"{name} must be finite and >= 0, got {value}"


def check_top_p(name: str, value: float, *_: Any) -> str | None:
    return None if 0.0 < value <= 1.0 else f"{name} must be in (0, 1], got {value}"


def check_top_k(name: str, value: int | None, *_: Any) -> str | None:
    if value is None or value >= 1:
        return None
    return f"{name} must be >= 1 (or null for no limit), got {value}"


def check_min_p(name: str, value: float, *_: Any) -> str | None:
    return None if 0.0 <= value <= 1.0 else f"{name} must be in [0, 1], got {value}"


def check_repetition_penalty(name: str, value: float, *_: Any) -> str | None:
    return None if 0.0 < value < math.inf else f"{name} must be finite and > 0, got {value}"


def check_openai_penalty(name: str, value: float, *_: Any) -> str | None:
    if -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY:
        return None
    return f"{name} must be in [-2, 2], got {value}"


PRIORITY_LIMIT = 2**31  # a class number, not a count: int32 is plenty


def check_priority(name: str, value: int, *_: Any) -> str | None:
    if -PRIORITY_LIMIT <= value < PRIORITY_LIMIT:
        return None
    return f"{name} must be in [-2**31, 2**31), got {value}"


def check_seed(name: str, value: int | None, *_: Any) -> str | None:
    if value is None or 0 <= value < SEED_LIMIT:
        return None
    return f"{name} must be in [0, 2**63), got {value}"


def check_stop(name: str, stop: list[str], *_: Any) -> str | None:
    # Every stop string is matched against each step's text (jobs/stop_strings.py) and sizes
    # the token window each item carries to the detokenizer: their length is per-token work.
    bounds = request_bounds()
    if len(stop) > bounds.max_stop_strings:
        return f"{name}: at most {bounds.max_stop_strings} stop strings, got {len(stop)}"
    if any(not s for s in stop):
        return f"{name}: a stop string is empty"
    longest = max(map(len, stop), default=0)
    if longest > bounds.max_stop_chars:
        return f"{name}: a stop string is {longest} characters, more than {bounds.max_stop_chars}"
    total = sum(map(len, stop))
    if total > bounds.max_stop_total_chars:
        return (
            f"{name}: the stop strings are {total} characters together, more than "
            f"{bounds.max_stop_total_chars}"
        )
    return None


def check_stop_token_ids(name: str, ids: list[int], _: Any, vocab_size: int) -> str | None:
    limit = request_bounds().max_stop_token_ids
    if len(ids) > limit:
        return f"{name}: at most {limit} token ids, got {len(ids)}"
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    return None if bad is None else f"{name}: token id {bad} is not in [0, {vocab_size})"


def check_logit_bias(name: str, bias: dict[int, float], _: Any, vocab_size: int) -> str | None:
    limit = request_bounds().max_logit_bias
    if len(bias) > limit:
        return f"{name}: at most {limit} entries, got {len(bias)}"
    for token, value in bias.items():
        if not 0 <= token < vocab_size:
            return f"{name}: token id {token} is not in [0, {vocab_size})"
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            return f"{name}: bias {value} for token {token} is not in [-100, 100]"
    return None


def check_top_logprobs(name: str, value: int, values: Mapping[str, Any], _: int) -> str | None:
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        return f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}"
    if value and not values["logprobs"] and not values.get("prompt_logprobs"):
        return f"{name} needs logprobs (or prompt_logprobs) set to true"
    return None


def check_grammar(name: str, value: str | None, values: Mapping[str, Any], _: int) -> str | None:
    """One structure at most, within the size and nesting bounds (jobs/grammar.py). Whether
    it compiles is checked apart, off the caller's thread: `wire_sampling`, the ingress's
    `compile_async`, the worker's compile pool."""
    if value is None:
        return None
    given = [field for field in GRAMMAR_FIELDS if values.get(field) is not None]
    if len(given) > 1:
        return f"{name}: give at most one of {', '.join(GRAMMAR_FIELDS)}, got {', '.join(given)}"
    return shape_problem(name, value)
