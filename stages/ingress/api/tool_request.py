"""OpenAI's tool calling, the request side: ``tools``, ``tool_choice``, ``parallel_tool_calls``
and the tool parts of chat messages.

The tools go to the tokenizer with the chat, whose template renders them
(jobs/tool_format.py), and decoding is constrained with a grammar (the ``ebnf`` sampling
parameter, Lark with llguidance's ``%json``) over calls in the Hermes format, each call's
arguments holding only the properties its tool declares (unless its schema allows more
explicitly: jobs/strict_schema.py). ``auto`` lets the model write any text, but a call it
opens must be one of the tools' (unless ``response_format`` gives the grammar instead);
``required`` allows only calls, one or more to any tool (one if ``parallel_tool_calls`` is
false), and a named function one call to it; so the calls always parse. ``none`` renders
no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jobs.grammar import JSON_OPTIONS
from jobs.strict_schema import strict_schema
from jobs.tool_format import CALL_CLOSE, CALL_OPEN
from jobs.unicode_text import check_unicode
from stages.ingress.body import ARRAY, BOOL, OBJECT, STR, field, reject_unknown, wrong_type
from stages.ingress.errors import ApiError

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128


@dataclass
class ToolCalling:
    """What one chat request asks of tools."""

    tools: list[dict[str, Any]]  # OpenAI's {"type": "function", "function": {...}} entries
    choice: str  # "auto", "required", or "function" (the one named by `function`)
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}

    def grammar(self) -> str:
        """The Lark grammar the output must match. `required` and a named function: calls
        only; `auto`: any text without the call tag, or text then calls (the text before a
        call's tag is matched lazily, up to the tag), so whatever call the model writes is
        one of the tools' with their declared arguments."""
        functions = [t["function"] for t in self.tools
                     if self.function in (None, t["function"]["name"])]  # fmt: skip
        calls = [_call_schema(f) for f in functions]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        # A named function is called once; `required` may call several, if parallel.
        many = self.parallel and self.function is None
        more = ' ("\\n" call)*' if many else ""
        rules = (f'call: "{CALL_OPEN}\\n" body\n'
                 f'body: %json{body} "\\n{CALL_CLOSE}"\n')  # fmt: skip
        if self.choice != "auto":
            return f"start: call{more}\n{rules}"
        return (f"start: TEXT | lead body{more}\n{rules}"
                f'lead[suffix="{CALL_OPEN}\\n"]: /(?s:.*)/\n'
                f"TEXT: /(?s:.*)/ & ~/(?s:.*{CALL_OPEN}.*)/\n")  # fmt: skip


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            # Only the declared arguments, as OpenAI's strict mode (jobs/strict_schema.py).
            "arguments": strict_schema(function.get("parameters") or {"type": "object"}),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_calling(data: dict[str, Any]) -> ToolCalling | None:
    """The tool calling a chat body asks for; None when it names no tools or chooses none."""
    tools = _tools(data.get("tools"))
    parallel = field(data, "parallel_tool_calls", BOOL)
    choice, function = _choice(data.get("tool_choice"), tools)
    if not tools or choice == "none":
        return None
    if choice != "auto" and data.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "response_format cannot be combined with tool_choice "
                       f"{choice!r}: the output must be tool calls", param="tool_choice",
                       code="invalid_value")  # fmt: skip
    return ToolCalling(tools, choice, function, True if parallel is None else parallel)


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise wrong_type("tools", value, "an array")
    if not 1 <= len(value) <= MAX_TOOLS:
        raise ApiError(400, f"tools must hold 1 to {MAX_TOOLS} tools, got {len(value)}",
                       param="tools", code="invalid_value")  # fmt: skip
    tools, seen = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(where, tool, "an object")
        reject_unknown(tool, ("type", "function"), where=f"in {where}: ")
        if field(tool, "type", STR, label=f"{where}.type") != "function":
            raise ApiError(400, f"{where}.type must be 'function'", param="tools",
                           code="invalid_value")  # fmt: skip
        function = field(tool, "function", OBJECT, label=f"{where}.function")
        if function is None:
            raise ApiError(400, f"{where}.function is required", param="tools",
                           code="missing_field")  # fmt: skip
        known = ("name", "description", "parameters", "strict")
        reject_unknown(function, known, where=f"in {where}.function: ")
        name = field(function, "name", STR, label=f"{where}.function.name")
        if name is None or not NAME_PATTERN.fullmatch(name):
            raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, _ "
                           f"or -; got {name!r}", param="tools", code="invalid_value")  # fmt: skip
        if name in seen:
            raise ApiError(400, f"{where}: a second tool named {name!r}", param="tools",
                           code="invalid_value")  # fmt: skip
        seen.add(name)
        field(function, "description", STR, label=f"{where}.function.description")
        field(function, "parameters", OBJECT, label=f"{where}.function.parameters")
        field(function, "strict", BOOL, label=f"{where}.function.strict")
        tools.append({"type": "function", "function": function})
    return tools


def _choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if not tools:
        raise ApiError(400, "tool_choice is only allowed when tools are given",
                       param="tool_choice", code="invalid_value")  # fmt: skip
    if isinstance(value, str):
        if value not in CHOICES:
            raise ApiError(400, f"tool_choice must be one of {', '.join(CHOICES)} or a "
                           f"function; got {value!r}", param="tool_choice",
                           code="invalid_value")  # fmt: skip
        return value, None
    if not isinstance(value, dict):
        raise wrong_type("tool_choice", value, "a string or an object")
    function = field(value, "function", OBJECT, label="tool_choice.function") or {}
    name = field(function, "name", STR, label="tool_choice.function.name")
    if value.get("type") != "function" or name is None:
        raise ApiError(400, 'tool_choice as an object must be {"type": "function", '
                       '"function": {"name": ...}}', param="tool_choice",
                       code="invalid_value")  # fmt: skip
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools",
                       param="tool_choice", code="invalid_value")  # fmt: skip
    return "function", name


# ---- the tool parts of messages ---------------------------------------------------------------


def assistant_tool_calls(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, arguments as objects (what templates expect)."""
    value = field(message, "tool_calls", ARRAY, label=f"{where}.tool_calls") or []
    calls = []
    for j, call in enumerate(value):
        label = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise wrong_type(label, call, "an object")
        function = field(call, "function", OBJECT, label=f"{label}.function") or {}
        name = field(function, "name", STR, label=f"{label}.function.name")
        arguments = field(function, "arguments", STR, label=f"{label}.function.arguments")
        if name is None:
            raise ApiError(400, f"{label}.function.name is required", param="messages",
                           code="missing_field")  # fmt: skip
        try:
            parsed = json.loads(arguments or "{}")
            check_unicode(parsed, arguments or "")
        except (ValueError, RecursionError) as exc:  # NotUnicode is a ValueError
            raise ApiError(400, f"{label}.function.arguments is not JSON: {exc}",
                           param="messages", code="invalid_value") from None  # fmt: skip
        call_id = field(call, "id", STR, label=f"{label}.id")
        entry = {"type": "function", "function": {"name": name, "arguments": parsed}}
        calls.append({**({"id": call_id} if call_id else {}), **entry})
    return calls


def tool_result_id(message: dict[str, Any], where: str) -> str:
    call_id = field(message, "tool_call_id", STR, label=f"{where}.tool_call_id")
    if call_id is None:
        raise ApiError(400, f"{where}.tool_call_id is required for a tool message",
                       param="messages", code="missing_field")  # fmt: skip
    return call_id


def openapi_properties() -> dict[str, Any]:
    """The tool fields and message parts in the OpenAPI description of the chat endpoint."""
    function = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": NAME_PATTERN.pattern},
            "description": {"type": "string"},
            "parameters": {"type": "object", "description": "a JSON Schema"},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    named = {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"const": "function"},
                            "function": {"type": "object", "required": ["name"],
                                         "properties": {"name": {"type": "string"}}}}}  # fmt: skip
    return {
        "tools": {
            "type": ["array", "null"], "minItems": 1, "maxItems": MAX_TOOLS,
            "items": {"type": "object", "required": ["type", "function"],
                      "properties": {"type": {"const": "function"}, "function": function}},
        },
        "tool_choice": {
            "anyOf": [{"enum": list(CHOICES)}, named, {"type": "null"}],
            "description": "auto (the default with tools): the model may call them; required "
            "or a named function: the output is calls, forced by a grammar",
        },
        "parallel_tool_calls": {"type": ["boolean", "null"]},
    }  # fmt: skip


def openapi_message_properties() -> dict[str, Any]:
    """What an assistant message (earlier calls) or a tool message (a result) adds."""
    function = {
        "type": "object",
        "required": ["name", "arguments"],
        "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
    }
    call = {"type": "object", "required": ["function"],
            "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                           "function": function}}  # fmt: skip
    return {
        "tool_calls": {"type": ["array", "null"], "items": call},
        "tool_call_id": {"type": "string", "description": "a tool message's call"},
    }
