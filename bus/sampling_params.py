"""SamplingParams: what one request asks of the sampler and of the stop checks.

Types are checked and normalised on construction (a single stop string becomes a list, JSON
string keys of logit_bias become ints); ranges are checked by `validate`, which needs the
model's vocabulary size. Every mistake is a ValueError whose message starts with the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# OpenAI's range for frequency_penalty and presence_penalty.
MAX_OPENAI_PENALTY = 2.0
# Below this a temperature is treated as greedy: dividing logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5
SEED_LIMIT = 2**63


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None  # None = off; 1 = greedy
    min_p: float = 0.0
    # HF semantics, over prompt + output tokens: positive logits / p, negative logits * p.
    repetition_penalty: float = 1.0
    # OpenAI semantics, over output tokens only: logit -= count * freq + (count > 0) * presence.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "top_logprobs"):
            _require_int(name, getattr(self, name))
        for name in ("top_k", "seed"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            setattr(self, name, _require_float(name, getattr(self, name)))
        for name in ("ignore_eos", "logprobs", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self.stop = _as_stop_list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        for token in self.stop_token_ids:
            _require_int("stop_token_ids", token)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = _as_logit_bias(self.logit_bias)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError, naming the field, for the first value out of its range."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        # Written as `not (lo <= x <= hi)` so that NaN fails too.
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or null for no limit), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop: a stop string is empty")
        for token in self.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise ValueError(f"stop_token_ids: token id {token} is not in [0, {vocab_size})")
        for token, bias in self.logit_bias.items():
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias: token id {token} is not in [0, {vocab_size})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: bias {bias} for token {token} is not in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")


def _require_int(name: str, value: Any) -> None:
    # bool is an int subclass; `true` for a count is a client bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _require_float(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _as_stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    return list(stop)


def _as_logit_bias(bias: Any) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    result: dict[int, float] = {}
    for key, value in bias.items():
        # JSON object keys are strings: {"50256": -100} means token 50256.
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
            token = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token = key
        else:
            raise ValueError(f"logit_bias: key {key!r} is not a token id")
        result[token] = _require_float("logit_bias", value)
    return result
