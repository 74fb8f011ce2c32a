"""Strict JSON Schemas: objects hold the properties they declare and no others.

JSON Schema lets an object hold any property it does not mention (``additionalProperties``
defaults to any value), so a grammar made from a tool's parameters accepted
``{"amount": 30, "from": "USD", "to": "EUR", "from_to": ...}``, and a small model, never
made to close the object, wrote undeclared keys until ``max_tokens``. OpenAI's ``strict``
function calling and xgrammar's strict mode read an object's missing
``additionalProperties`` as ``false``; `strict_schema` writes that ``false`` in, so
llguidance (jobs/grammar.py) allows only the declared properties. An object that says
``additionalProperties: true`` or gives a schema for them keeps it.

An object whose properties may come from elsewhere is left as it is: one beside ``$ref``,
``allOf``, ``anyOf``, ``oneOf`` or ``if`` (closing it would refuse what those add), the
parts of an ``allOf``, and the branches of an ``anyOf``/``oneOf`` in an object that declares
properties of its own (closing them would refuse each other's or their parent's
properties). Their nested schemas are still made strict.
"""

from __future__ import annotations

from typing import Any

from jobs.request_bounds import request_bounds

# Keywords whose value is one subschema, a list of them, or a mapping of name -> subschema.
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_MANY = ("prefixItems",)
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COMBINATORS = ("allOf", "anyOf", "oneOf")
# Beside these an object's properties may come from another schema: it is not closed.
_OPEN_BESIDE = ("$ref", "$dynamicRef", "if", "unevaluatedProperties", *_COMBINATORS)


class _TooDeep(Exception):
    pass


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` where every object that does not say what else it allows
    allows nothing but its declared properties (see the module docstring). A schema nested
    deeper than a grammar may be comes back as it is: its compile refuses it, naming the
    field (jobs/grammar.py), and a client's nesting never runs this recursion out of stack."""
    try:
        return _strict(schema, True, request_bounds().max_grammar_depth)
    except _TooDeep:
        return schema


def _strict(schema: Any, closable: bool, depth: int) -> Any:
    if not isinstance(schema, dict):
        return schema  # true, false, or not a schema at all (the compiler says so)
    if depth <= 0:
        raise _TooDeep
    depth -= 1
    out = dict(schema)
    for key in _ONE:
        if key in out and isinstance(out[key], (dict, list)):
            value = out[key]
            out[key] = [_strict(s, True, depth) for s in value] if isinstance(value, list) else (
                _strict(value, True, depth))  # fmt: skip
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s, True, depth) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(s, True, depth) for name, s in out[key].items()}
    # An alternative's branches are closed only where their parent adds no properties;
    # allOf's never (each part may declare some of the properties).
    for key in _COMBINATORS:
        if isinstance(out.get(key), list):
            closable_branches = key != "allOf" and not _declares_properties(out)
            out[key] = [_strict(s, closable_branches, depth) for s in out[key]]
    if closable and _is_object(out) and "additionalProperties" not in out:
        if not any(key in out for key in _OPEN_BESIDE):
            out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind is not None:
        return kind == "object" or (isinstance(kind, list) and "object" in kind)
    return _declares_properties(schema)


def _declares_properties(schema: dict[str, Any]) -> bool:
    return any(key in schema for key in ("properties", "required", "patternProperties"))
