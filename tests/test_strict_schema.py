"""Strict schemas (jobs/strict_schema.py) and the grammars made from them: a tool's arguments,
and a ``response_format`` under ``strict: true``, hold the declared properties and no others;
with ``auto`` the model may write any text, but a call it opens is a tool's. Checked against
llguidance's own matcher over a byte-level vocabulary, so any text can be fed to it."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer
from llguidance._tokenizer import TokenizerWrapper

from jobs.grammar import compile_grammar
from jobs.strict_schema import strict_schema
from stages.ingress.api.response_format import response_schema
from stages.ingress.api.tool_request import tool_calling

CONVERT = {"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                     "to": {"type": "string"}},
    "required": ["amount", "from", "to"]}}}  # fmt: skip
ARGUMENTS = '{"amount":30,"from":"USD","to":"EUR"}'
CALL = f'<tool_call>\n{{"name":"convert","arguments":{ARGUMENTS}}}\n</tool_call>'
EXTRA_KEY = (
    '<tool_call>\n{"name":"convert","arguments":{"amount":30,"from":"USD","to":"EUR","from_to"'
)


class _Bytes:
    """A vocabulary of the 256 bytes and an end token."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


@pytest.fixture(scope="module")
def byte_tokenizer():
    return LLTokenizer(TokenizerWrapper(_Bytes()))


def _accepts(tokenizer, name: str, spec: str, text: str, whole: bool = True) -> bool:
    """Whether the grammar allows `text` (as a whole answer, or as the start of one)."""
    matcher = LLMatcher(tokenizer, compile_grammar(name, spec))
    if not matcher.consume_tokens(list(text.encode())) or matcher.is_error():
        return False
    return matcher.is_accepting() if whole else True


def test_objects_are_closed_unless_they_say_otherwise():
    schema = {
        "type": "object",
        "properties": {
            "plain": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "typed": {"type": "object", "additionalProperties": {"type": "string"}},
            "list": {"type": "array", "items": {"properties": {"b": {}}}},
            "union": {"anyOf": [{"type": "object", "properties": {"c": {}}}, {"type": "null"}]},
            "merged": {"allOf": [{"properties": {"d": {}}}, {"properties": {"e": {}}}]},
        },
        "$defs": {"x": {"type": "object", "properties": {"f": {}}}},
    }
    strict = strict_schema(schema)
    props = strict["properties"]
    assert strict["additionalProperties"] is False
    assert props["plain"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "string"}
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["union"]["anyOf"][0]["additionalProperties"] is False
    # allOf's parts each declare some of the properties: closing one would refuse the other's.
    assert "additionalProperties" not in props["merged"]
    assert all("additionalProperties" not in part for part in props["merged"]["allOf"])
    assert strict["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


NAMED = {"type": "function", "function": {"name": "convert"}}


@pytest.mark.parametrize("choice", ["required", "auto", NAMED])
def test_a_call_holds_only_the_declared_arguments(byte_tokenizer, choice):
    grammar = tool_calling({"tools": [CONVERT], "tool_choice": choice}).grammar()
    assert _accepts(byte_tokenizer, "ebnf", grammar, CALL)
    assert not _accepts(byte_tokenizer, "ebnf", grammar, EXTRA_KEY, whole=False)


def test_auto_allows_any_text_and_text_before_calls(byte_tokenizer):
    grammar = tool_calling({"tools": [CONVERT], "tool_choice": "auto"}).grammar()
    for text in ["30 dollars are 27 euros.", "a < b, <tool but no call", f"Let me see.\n{CALL}",
                 f"{CALL}\n{CALL}"]:  # fmt: skip
        assert _accepts(byte_tokenizer, "ebnf", grammar, text), text
    assert not _accepts(byte_tokenizer, "ebnf", grammar, '<tool_call>\n{"name":"other"', False)
    assert not _accepts(byte_tokenizer, "ebnf", grammar, CALL + " and more text")


@pytest.mark.parametrize("strict", [True, False, None])
def test_response_format_under_strict_refuses_undeclared_properties(byte_tokenizer, strict):
    spec = {"name": "money", "schema": CONVERT["function"]["parameters"]}
    if strict is not None:
        spec["strict"] = strict
    schema = response_schema({"response_format": {"type": "json_schema", "json_schema": spec}})
    text = json.dumps(schema, separators=(",", ":"))
    extra = '{"amount":30,"from":"USD","to":"EUR","note":"x"}'
    assert _accepts(byte_tokenizer, "json_schema", text, '{"amount":30,"from":"USD","to":"EUR"}')
    assert _accepts(byte_tokenizer, "json_schema", text, extra) is not bool(strict)


def test_a_schema_too_deep_for_a_grammar_comes_back_as_it_is():
    deep: dict = {"type": "object", "properties": {}}
    for _ in range(5000):  # past any stack: the grammar's depth bound refuses it later
        deep = {"type": "object", "properties": {"x": deep}}
    assert strict_schema(deep) is deep
    shallow = {"type": "object", "properties": {"x": {"type": "object", "properties": {}}}}
    assert strict_schema(shallow)["properties"]["x"]["additionalProperties"] is False
