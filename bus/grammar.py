"""Structured output: the grammar a request's output must match.

A request asks for it with one of three sampling parameters: ``json_schema`` (a JSON
Schema, which OpenAI's ``response_format`` becomes), ``regex``, or ``ebnf`` (llama.cpp's GBNF,
which SGLang and xgrammar call EBNF, or a Lark grammar). llguidance turns each into one
grammar string; the worker builds a matcher from it, and that matcher masks, step by step,
every token the grammar does not allow. llguidance needs no torch, so the ingress checks a
grammar here before anything is queued and answers a 400 that says why it does not compile;
checks are cached, as a client tends to send one schema many times.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# Compact JSON: a small model given free whitespace can fill max_tokens with newlines.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHED_GRAMMARS = 1024


def grammar_of(values: Mapping[str, Any]) -> str | None:
    """llguidance's grammar for a request's parameters (a SamplingParams' fields by name),
    or None when it asks for no structure. The parameters must have passed their checks."""
    for name in GRAMMAR_FIELDS:
        spec = values.get(name)
        if spec is not None:
            return _compiled(name, spec)[0]
    return None


def grammar_problem(name: str, spec: str) -> str | None:
    """Why `spec`, given as parameter `name`, is not a grammar the matcher can use; None if
    it is."""
    return _compiled(name, spec)[1]


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _compiled(name: str, spec: str) -> tuple[str, str | None]:
    """(grammar, problem or None), once per distinct spec."""
    try:
        if name == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif name == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        else:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(spec))
    except (GbnfToLarkError, ValueError, TypeError) as exc:
        return "", str(exc)
    problem = LLMatcher.validate_grammar(grammar)
    return grammar, problem.strip() or None


def json_schema_text(value: Any) -> str | None:
    """A schema given as an object or as its JSON text, as JSON text (the wire's form);
    ValueError if it is neither."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON Schema object")
    return json.dumps(value, separators=(",", ":"))
