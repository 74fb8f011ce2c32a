"""A ``/v1/responses`` body, checked and turned into the chat request the pipeline runs.

The body becomes a chat completions body that ``params.parse_chat`` checks, so every
sampling, grammar and tool rule of chat holds here too; an error it finds is renamed to the
Responses field it came from (``messages`` is ``input``, ``max_tokens`` is
``max_output_tokens``, ``response_format`` is ``text``). ``input`` (a string, or a list of
messages and function call items) becomes chat messages: a message's ``input_text`` and
``output_text`` parts its text, a ``function_call`` item an assistant message's tool call,
a ``function_call_output`` a tool message. Those messages, the answer's appended, are what
a later turn's ``previous_response_id`` puts before its own input; ``instructions`` are
this turn's only, as OpenAI has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batch_store.metadata import MAX_METADATA_PAIRS, METADATA_SCHEMA, metadata_too_long
from stages.ingress.api.params import ApiRequest, parse_chat
from stages.ingress.body import BOOL, NUMBER, OBJECT, STR, field, reject_unknown, wrong_type
from stages.ingress.errors import ApiError

# OpenAI fields taken at the values that ask nothing this server does not do (what SDKs send
# by default); any other value is a 400 naming the field. Hints with no effect here:
# prompt_cache_key (the router's prefix cache needs none), safety_identifier.
INERT = {
    "truncation": ("disabled",),
    "include": ([],),
    "reasoning": ({},),
    "service_tier": ("auto", "default"),
    "stream_options": ({}, {"include_obfuscation": False}),  # events carry no padding here
}
HINTS = ("prompt_cache_key", "safety_identifier")
FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text",
          "tools", "tool_choice", "parallel_tool_calls", "stream", "store", "background",
          "previous_response_id", "metadata", "user", *INERT, *HINTS)  # fmt: skip
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
FORMATS = ("text", "json_object", "json_schema")
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
# A chat field (as parse_chat names it in an error) -> the Responses field it came from.
CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


@dataclass
class ResponsesRequest:
    """What one create asks for, beside the chat job it becomes (`chat_job`)."""

    data: dict[str, Any]  # the body as given
    input: list[dict[str, Any]]  # this turn's input, as chat messages
    instructions: str | None
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    metadata: dict[str, str]

    def chat_job(self, history: list[dict[str, Any]], served: str) -> ApiRequest:
        """The chat job of this turn, after `history` (the earlier turns' messages)."""
        data = self.data
        lead = [] if self.instructions is None else [{"role": "system",
                                                      "content": self.instructions}]  # fmt: skip
        chat: dict[str, Any] = {"model": served, "messages": [*lead, *history, *self.input]}
        for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
            if data.get(name) is not None:
                chat[name] = data[name]
        if data.get("max_output_tokens") is not None:
            chat["max_tokens"] = data["max_output_tokens"]
        if self.stream:
            chat["stream"] = True
        response_format = _response_format(data.get("text"))
        if response_format is not None:
            chat["response_format"] = response_format
        if data.get("tools") is not None:
            chat["tools"] = _tools(data["tools"])
        if data.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(data["tool_choice"])
        try:
            return parse_chat(chat, served)
        except ApiError as exc:
            raise renamed(exc) from None


def parse_responses(data: dict[str, Any], served: str) -> ResponsesRequest:
    """Check what the chat body does not carry; `chat_job` checks the rest."""
    reject_unknown(data, FIELDS)
    model = field(data, "model", STR)
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves "
                       f"`{served}`).", param="model", code="model_not_found")  # fmt: skip
    if data.get("input") is None:
        raise ApiError(400, "input is required", param="input", code="missing_field")
    stream = bool(field(data, "stream", BOOL))
    store = field(data, "store", BOOL)
    background = bool(field(data, "background", BOOL))
    if background and store is False:
        raise ApiError(400, "background responses must be stored: store cannot be false",
                       param="store", code="invalid_value")  # fmt: skip
    if background and stream:
        raise ApiError(400, "stream is not supported with background: poll the response "
                       "with GET /v1/responses/{id}", param="stream",
                       code="invalid_value")  # fmt: skip
    for name in ("temperature", "top_p"):
        field(data, name, NUMBER)
    for name in HINTS:
        field(data, name, STR)
    for name, inert in INERT.items():
        value = data.get(name)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None}
        if value is not None and value not in inert:
            raise ApiError(400, f"{name} {data[name]!r} is not supported: leave it out or give "
                           f"{' or '.join(map(repr, inert))}", param=name,
                           code="unsupported_value")  # fmt: skip
    return ResponsesRequest(
        data=data,
        input=input_messages(data["input"]),
        instructions=field(data, "instructions", STR),
        stream=stream,
        store=store is not False,
        background=background,
        previous_response_id=field(data, "previous_response_id", STR),
        metadata=_metadata(data.get("metadata")),
    )


def renamed(exc: ApiError) -> ApiError:
    """`exc` from parse_chat, in the words of the Responses body."""
    param = CHAT_NAMES.get(exc.param or "", exc.param)
    message = exc.message
    for chat_name, name in CHAT_NAMES.items():
        message = message.replace(chat_name, name)
    return ApiError(exc.status, message, exc.type, param, exc.code, headers=exc.headers)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages (checked again, as chat's, by parse_chat)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise wrong_type("input", value, "a string or an array of items")
    if not value:
        raise ApiError(400, "input must not be empty", param="input", code="invalid_value")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(where, item, "an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # a turn's parallel calls: one message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            reject_unknown(item, ("type", "call_id", "output", "id", "status"),
                           where=f"in {where}: ")  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": _required(item, "call_id", where),
                             "content": _required(item, "output", where)})  # fmt: skip
        else:
            raise ApiError(400, f"{where}.type {kind!r} is not supported: give messages, "
                           "function_call or function_call_output items", param="input",
                           code="unsupported_input")  # fmt: skip
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    reject_unknown(item, ("type", "role", "content", "id", "status"), where=f"in {where}: ")
    role = field(item, "role", STR, label=f"{where}.role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}",
                       param="input", code="invalid_value")  # fmt: skip
    content = item.get("content")
    if not isinstance(content, list):
        return {"role": role, "content": content}  # a string, or parse_chat's 4xx
    parts = []
    for j, part in enumerate(content):  # as chat's text parts, which parse_chat joins
        if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
            raise ApiError(400, f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}"
                           f") are supported, got type {part.get('type')!r}", param="input",
                           code="unsupported_content")  # fmt: skip
        parts.append({**part, "type": "text"} if isinstance(part, dict) else part)
    return {"role": role, "content": parts}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    reject_unknown(item, ("type", "call_id", "name", "arguments", "id", "status"),
                   where=f"in {where}: ")  # fmt: skip
    return {"id": _required(item, "call_id", where), "type": "function",
            "function": {"name": _required(item, "name", where),
                         "arguments": _required(item, "arguments", where)}}  # fmt: skip


def _required(item: dict[str, Any], name: str, where: str) -> str:
    value = field(item, name, STR, label=f"{where}.{name}")
    if value is None:
        raise ApiError(400, f"{where}.{name} is required", param="input", code="missing_field")
    return value


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise wrong_type("metadata", value, "an object of strings")
    problem = (f"metadata holds at most {MAX_METADATA_PAIRS} pairs"
               if len(value) > MAX_METADATA_PAIRS else metadata_too_long(value))  # fmt: skip
    if problem is not None:
        raise ApiError(400, problem, param="metadata", code="invalid_value")
    return value


def _response_format(value: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (its schema's fields one level down)."""
    text = field({"text": value}, "text", OBJECT)
    if text is None:
        return None
    reject_unknown(text, ("format", "verbosity"), where="in text: ")
    spec = field(text, "format", OBJECT, label="text.format")
    if spec is None:
        return None
    kind = field(spec, "type", STR, label="text.format.type")
    if kind not in FORMATS:
        raise ApiError(400, f"text.format.type must be one of {', '.join(FORMATS)}; got "
                       f"{kind!r}", param="text", code="invalid_value")  # fmt: skip
    if kind != "json_schema":
        reject_unknown(spec, ("type",), where="in text.format: ")
        return {"type": kind}
    reject_unknown(spec, ("type", "name", "schema", "strict", "description"),
                   where="in text.format: ")  # fmt: skip
    if spec.get("schema") is None:
        raise ApiError(400, "text.format.schema is required with type json_schema",
                       param="text", code="missing_field")  # fmt: skip
    schema = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
    return {"type": "json_schema", "json_schema": schema}


def _tools(value: Any) -> Any:
    """Responses' flat function tools as chat's ``{"type", "function": {...}}``."""
    if not isinstance(value, list):
        return value  # parse_chat says what is wrong
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            tools.append(tool)  # parse_chat says what is wrong with it
            continue
        reject_unknown(tool, TOOL_FIELDS, where=f"in tools[{i}]: ")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    """``{"type": "function", "name": ...}`` as chat's; strings as they are."""
    if not isinstance(value, dict):
        return value
    name = field(value, "name", STR, label="tool_choice.name")
    if value.get("type") != "function" or name is None:
        raise ApiError(400, 'tool_choice as an object must be {"type": "function", "name": '
                       "...}", param="tool_choice", code="invalid_value")  # fmt: skip
    return {"type": "function", "function": {"name": name}}


def openapi_schema() -> dict[str, Any]:
    """The create body in the OpenAPI description (stages/ingress/api/openapi.py)."""
    part = {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": list(ROLES)},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]},
        },
    }
    call = {
        "type": "object",
        "required": ["type", "call_id", "name", "arguments"],
        "properties": {
            "type": {"const": "function_call"},
            "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string"},
        },
    }
    output = {
        "type": "object",
        "required": ["type", "call_id", "output"],
        "properties": {
            "type": {"const": "function_call_output"},
            "call_id": {"type": "string"},
            "output": {"type": "string"},
        },
    }
    tool = {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string"},
            "description": {"type": "string"},
            "parameters": {"type": "object"},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    text_format = {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": list(FORMATS)},
            "name": {"type": "string"},
            "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]},
            "description": {"type": "string"},
        },
    }
    choice = {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
            },
            {"type": "null"},
        ]
    }
    nullable_bool = {"type": ["boolean", "null"]}
    properties = {
        "model": {"type": ["string", "null"]},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                 "items": {"anyOf": [message, call, output]}}]},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        # As every endpoint takes it (jobs/sampling_checks.py): finite and >= 0, no maximum.
        "temperature": {"type": ["number", "null"], "minimum": 0},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "text": {"type": ["object", "null"], "properties": {"format": text_format}},
        "tools": {"type": ["array", "null"], "items": tool},
        "tool_choice": choice,
        "parallel_tool_calls": nullable_bool,
        "stream": nullable_bool,
        "store": nullable_bool,
        "background": nullable_bool,
        "previous_response_id": {"type": ["string", "null"]},
        "metadata": {**METADATA_SCHEMA, "type": ["object", "null"]},
        "user": {"type": ["string", "null"]},
        **{name: {"anyOf": [{"const": v} for v in inert] + [{"type": "null"}],
                  "description": "accepted at this value only"} for name, inert in INERT.items()},
        **{name: {"type": ["string", "null"], "description": "ignored"} for name in HINTS},
    }  # fmt: skip
    assert set(properties) == set(FIELDS)
    return {"type": "object", "required": ["input"], "properties": properties,
            "additionalProperties": False}  # fmt: skip
