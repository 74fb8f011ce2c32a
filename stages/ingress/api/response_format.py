"""OpenAI's ``response_format``: the structure a chat or completion's output must have.

``{"type": "text"}`` asks for none; ``{"type": "json_object"}`` for any JSON object;
``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` for
JSON matching ``schema``. Both JSON kinds become the ``json_schema`` sampling parameter, so
the worker constrains decoding to it (jobs/grammar.py); a schema that does not compile is a 400
naming ``response_format``. The output always matches, ``strict`` or not: the grammar allows
nothing else. With ``strict: true`` an object holds only the properties it declares, unless
it allows more explicitly (jobs/strict_schema.py), as OpenAI's strict mode; without it the
schema means what JSON Schema says (undeclared properties allowed).
"""

from __future__ import annotations

from typing import Any

from jobs.strict_schema import strict_schema
from stages.ingress.body import BOOL, OBJECT, STR, field, wrong_type
from stages.ingress.errors import ApiError

NAME = "response_format"
KINDS = ("text", "json_object", "json_schema")
ANY_OBJECT = {"type": "object"}


def response_schema(data: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema that `data`'s response_format asks the output to match, if any."""
    value = data.get(NAME)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(NAME, value, "an object")
    kind = field(value, "type", STR, label=f"{NAME}.type")
    if kind not in KINDS:
        raise ApiError(
            400, f"{NAME}.type must be one of {', '.join(KINDS)}; got {kind!r}",
            param=NAME, code="invalid_value",
        )  # fmt: skip
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    spec = field(value, "json_schema", OBJECT, label=f"{NAME}.json_schema")
    if spec is None:
        raise ApiError(400, f"{NAME}.json_schema is required with type json_schema",
                       param=NAME, code="missing_field")  # fmt: skip
    for name, kind_of_value in (("name", STR), ("description", STR)):
        field(spec, name, kind_of_value, label=f"{NAME}.json_schema.{name}")
    strict = field(spec, "strict", BOOL, label=f"{NAME}.json_schema.strict")
    schema = field(spec, "schema", OBJECT, label=f"{NAME}.json_schema.schema")
    if schema is None:
        return ANY_OBJECT
    return strict_schema(schema) if strict else schema


def openapi_property() -> dict[str, Any]:
    """response_format in the OpenAPI description of both OpenAI endpoints."""
    return {
        "type": ["object", "null"],
        "required": ["type"],
        "properties": {
            "type": {"enum": list(KINDS)},
            "json_schema": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]},
                },
            },
        },
        "description": "the structure the output must have: a JSON object, or JSON matching "
        "a schema",
    }
