"""Reading a JSON request body and its fields by JSON type.

Status codes follow the OpenAI-compatible servers: bytes that are not JSON are a 400, JSON
that is not an object or a field of the wrong JSON type a 422, an unknown field or a value
out of range a 400. JSON's ``null`` counts as "not given" for every optional field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from jobs.unicode_text import NotUnicode, check_unicode
from stages.ingress.errors import ApiError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what msgpack and the worker can carry

# JSON kinds a field may have.
STR, INT, NUMBER, BOOL, OBJECT, ARRAY = "string", "integer", "number", "boolean", "object", "array"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# One decoder for every body: json.loads with an argument builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


async def read_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (413 past client_max_size comes from `read`)."""
    raw = await request.read()
    try:
        # Strictly: a surrogate's bytes are no character (json.loads lets them through).
        text = raw.decode(json.detect_encoding(raw))
        data = _DECODER.decode(text)  # NaN and Infinity are Python's extension, not JSON
    except (ValueError, RecursionError) as exc:
        raise ApiError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    try:
        check_unicode(data, text)
    except NotUnicode as exc:
        param = exc.where.split(".")[0].split("[")[0] or None
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None
    if not isinstance(data, dict):
        raise ApiError(
            422,
            f"the request body must be a JSON object, not {json_kind(data)}",
            code="invalid_type",
        )
    return data


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        return INT
    if isinstance(value, float):
        return NUMBER
    if isinstance(value, str):
        return STR
    if isinstance(value, list):
        return ARRAY
    return OBJECT


def is_kind(value: Any, kind: str) -> bool:
    actual = json_kind(value)
    if kind == INT and _integral(value):
        return True
    return actual == kind or (kind == NUMBER and actual == INT)


def _integral(value: Any) -> bool:
    """2.0 is an integer to JSON Schema (and to OpenAI's API), if not to Python's json."""
    return isinstance(value, float) and value.is_integer()


def wrong_type(name: str, value: Any, expected: str) -> ApiError:
    return ApiError(
        422, f"{name} must be {expected}, got {json_kind(value)}", param=name, code="invalid_type"
    )


def reject_unknown(data: dict[str, Any], known: Iterable[str], where: str = "") -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ApiError(
            400,
            f"unknown field{'s' if len(unknown) > 1 else ''} {where}"
            f"{', '.join(map(repr, unknown))}",
            param=unknown[0],
            code="unknown_field",
        )


def field(data: dict[str, Any], name: str, *kinds: str, label: str | None = None) -> Any:
    """``data[name]`` if it has one of `kinds`, None if absent or null, else a 422."""
    value = data.get(name)
    label = label or name
    if value is None:
        return None
    if not any(is_kind(value, kind) for kind in kinds):
        raise wrong_type(label, value, " or ".join(kinds))
    if INT in kinds and NUMBER not in kinds and _integral(value):
        value = int(value)
    if json_kind(value) == INT and not INT64_MIN <= value <= INT64_MAX:
        raise ApiError(400, f"{label} is out of range: {value}", param=label, code="invalid_value")
    return value


def int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(is_kind(v, INT) for v in value):
        raise wrong_type(name, value, "an array of integers")
    return [int(v) for v in value]
