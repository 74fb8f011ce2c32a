"""Structured output: the grammar a request's output must match.

A request asks for it with one of three sampling parameters: ``json_schema`` (a JSON
Schema, which OpenAI's ``response_format`` becomes), ``regex``, or ``ebnf`` (llama.cpp's GBNF,
which SGLang and xgrammar call EBNF, or a Lark grammar). llguidance turns each into one
grammar string; the worker builds a matcher from it, and that matcher masks, step by step,
every token the grammar does not allow. llguidance needs no torch, so the ingress checks a
grammar here before anything is queued and answers a 400 that says why it does not compile;
compiled grammars are cached, as a client tends to send one schema many times.

Failure rules: a grammar is a client's text, so nothing it makes the compiler do may cost
the process. `shape_problem` bounds its size and bracket nesting before anything parses it
(Python's json and llguidance's converters recurse); `compile_grammar` turns whatever the
compiler raises (RecursionError, MemoryError, OverflowError, llguidance's errors) into a
`GrammarError` naming the field; and it runs in `COMPILE_POOL`, waited for at most the
compile deadline (`STREAMSERVE_GRAMMAR_COMPILE_TIMEOUT_S`). A compile past its deadline
goes on in its thread (Python cannot stop one) but its request is refused; a flood of them
fills the pool's threads, so later grammars queue and are refused at their deadlines too,
while requests without a grammar go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import Mapping
from typing import Any

from jobs.field_error import FieldError
from jobs.request_bounds import request_bounds

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# Compact JSON: a small model given free whitespace can fill max_tokens with newlines.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHED_GRAMMARS = 1024
COMPILE_THREADS = 4
COMPILE_POOL = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "grammar-compile")
OPENERS, CLOSERS = "[{(", "]})"


class GrammarError(FieldError):
    """A grammar that is too big, too deep, does not compile or compiles too slowly."""


def grammar_field(values: Mapping[str, Any]) -> str | None:
    """The grammar parameter a request gives (a SamplingParams' fields by name), or None."""
    return next((name for name in GRAMMAR_FIELDS if values.get(name) is not None), None)


def shape_problem(name: str, spec: str) -> str | None:
    """Why `spec` is too big or too deeply nested to be handed to a parser; None if it is
    not. Linear in its length, and safe on any text."""
    bounds = request_bounds()
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > bounds.max_grammar_bytes:
        return f"{name} is {size} bytes, more than the {bounds.max_grammar_bytes} allowed"
    depth = bracket_depth(spec, json_strings=name == "json_schema")
    if depth > bounds.max_grammar_depth:
        return (
            f"{name} nests brackets {depth} deep, more than the {bounds.max_grammar_depth} allowed"
        )
    return None


def bracket_depth(text: str, json_strings: bool) -> int:
    """The deepest nesting of ([{ in `text`. With `json_strings`, brackets inside JSON
    strings do not count (they are exact for JSON); otherwise every bracket counts, and a
    closer never takes the depth below zero."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif json_strings and char == '"':
            in_string = True
        elif char in OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif char in CLOSERS and depth:
            depth -= 1
    return deepest


def compile_grammar(name: str, spec: str) -> str:
    """llguidance's grammar for `spec`, given as parameter `name`; GrammarError if it is too
    big or deep, or does not compile. Runs the compiler here: call it from a pool thread
    (`compile_with_deadline`, `compile_async`), not from an event loop or the engine."""
    problem = shape_problem(name, spec)
    if problem is not None:
        raise GrammarError(name, problem)
    grammar, problem = _compiled(name, spec)
    if problem is not None:
        raise GrammarError(name, f"{name} does not compile: {problem}")
    return grammar


def compile_with_deadline(name: str, spec: str, timeout_s: float | None = None) -> str:
    """`compile_grammar` in the pool, waited for from a blocking caller at most the compile
    deadline; GrammarError past it."""
    future = COMPILE_POOL.submit(compile_grammar, name, spec)
    deadline = request_bounds().grammar_compile_timeout_s if timeout_s is None else timeout_s
    try:
        return future.result(timeout=deadline)
    except concurrent.futures.TimeoutError:
        raise GrammarError(name, too_slow(name, deadline)) from None


async def compile_async(name: str, spec: str) -> str:
    """`compile_grammar` off the event loop, with the compile deadline; GrammarError."""
    deadline = request_bounds().grammar_compile_timeout_s
    future = asyncio.get_running_loop().run_in_executor(COMPILE_POOL, compile_grammar, name, spec)
    try:
        return await asyncio.wait_for(future, deadline)
    except TimeoutError:
        raise GrammarError(name, too_slow(name, deadline)) from None


def too_slow(name: str, deadline: float) -> str:
    return f"{name}: the grammar took longer than {deadline:g} s to compile"


def grammar_problem(name: str, spec: str) -> str | None:
    """Why `spec`, given as parameter `name`, is not a grammar the matcher can use; None if
    it is. Compiles in the calling thread."""
    try:
        compile_grammar(name, spec)
    except GrammarError as exc:
        return str(exc)
    return None


def grammar_of(values: Mapping[str, Any]) -> str | None:
    """llguidance's grammar for a request's parameters, or None when it asks for no
    structure; compiles in the calling thread (see `compile_grammar`). GrammarError."""
    name = grammar_field(values)
    return None if name is None else compile_grammar(name, values[name])


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _compiled(name: str, spec: str) -> tuple[str, str | None]:
    """(grammar, problem or None), once per distinct spec."""
    # Imported at the first compile: every stage loads this module (jobs.protocol reaches
    # it), and llguidance's import was ~0.06 s of each one's start, where only a request
    # that asks for structure needs it.
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if name == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif name == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        else:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(spec))
        problem = LLMatcher.validate_grammar(grammar)
    # A client's text: whatever the converters or the compiler raise (RecursionError,
    # MemoryError, OverflowError, llguidance's own errors) is its problem, not this process's.
    except Exception as exc:
        return "", f"{type(exc).__name__}: {exc}"[:1000]
    return grammar, problem.strip() or None


def json_schema_text(value: Any) -> str | None:
    """A schema given as an object or as its JSON text, as JSON text (the wire's form);
    ValueError if it is neither, or too big or deep to parse."""
    if value is None:
        return None
    if isinstance(value, str):
        problem = shape_problem("json_schema", value)
        if problem is not None:
            raise ValueError(problem.removeprefix("json_schema "))
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON Schema object")
    try:
        return json.dumps(value, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError) as exc:  # NaN, a non-JSON value, depth
        raise ValueError(f"is not JSON: {exc}") from None
