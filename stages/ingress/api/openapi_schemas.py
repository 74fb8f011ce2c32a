"""The request schemas of the OpenAPI description (openapi.py), built from the tables the
parsers check bodies against (params.py, and the sampling parameters' table in
jobs/sampling_params.py): a field the server accepts is a field the description names, with
the same JSON types.
"""

from __future__ import annotations

from typing import Any

from jobs.protocol import MAX_TOKEN_ID
from jobs.request_bounds import request_bounds
from jobs.sampling_params import SAMPLING_FIELDS, Param
from stages.ingress.api import response_format, tool_request
from stages.ingress.api.params import (
    CHAT_FIELDS,
    CHAT_ROLES,
    COMPLETION_FIELDS,
    GENERATE_FIELDS,
    OPENAI_SAMPLING,
)

TOKEN_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
    "minItems": 1,
}


def _sampling_property(param: Param) -> dict[str, Any]:
    """A sampling parameter's schema, read off its row in the table (null: not given)."""
    doc = param.doc if param.off_value is None else f"{param.doc}; {param.off_value} too means null"
    return {"type": [*param.kind.json, "null"], **param.kind.schema, "description": doc}


def _sampling_properties() -> dict[str, Any]:
    return {param.name: _sampling_property(param) for param in SAMPLING_FIELDS}


def _openai_properties() -> dict[str, Any]:
    properties = {}
    for name, param in OPENAI_SAMPLING.items():
        properties[name] = _sampling_property(param)
    properties.update(
        model={"type": "string", "description": "the served model (GET /v1/models)"},
        n={"type": ["integer", "null"], "minimum": 1, "maximum": request_bounds().max_choices},
        stream={"type": ["boolean", "null"]},
        stream_options={
            "type": ["object", "null"],
            "properties": {
                "include_usage": {"type": ["boolean", "null"]},
                "include_obfuscation": {
                    "type": ["boolean", "null"],
                    "description": "only false: events carry no obfuscation padding",
                },
                "resumable": {
                    "type": ["boolean", "null"],
                    "description": "true: each event "
                    "carries an id to resume the stream from (Last-Event-ID); "
                    "false: none, whatever the headers say",
                },
            },
            "additionalProperties": False,
            "description": "only with stream: true",
        },
        user={"type": ["string", "null"]},
        response_format=response_format.openapi_property(),
    )
    return properties


def chat_request() -> dict[str, Any]:
    part = {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"const": "text"}, "text": {"type": ["string", "null"]}},
    }
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": sorted(CHAT_ROLES)},
            "content": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": part}, {"type": "null"}]
            },  # fmt: skip
            **tool_request.openapi_message_properties(),
        },
        # Only an assistant's message (a reply that may be tool calls alone) lacks content.
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    }
    properties = _openai_properties()
    properties.update(
        messages={"type": "array", "items": message, "minItems": 1},
        logprobs={"type": ["boolean", "null"]},
        top_logprobs={"type": ["integer", "null"], "minimum": 0},
        **tool_request.openapi_properties(),
    )
    return _object(properties, CHAT_FIELDS, ["model", "messages"])


def completion_request() -> dict[str, Any]:
    properties = _openai_properties()
    properties.update(
        prompt={
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                TOKEN_IDS,
                {"type": "array", "items": TOKEN_IDS, "minItems": 1},
            ]
        },
        logprobs={
            "type": ["integer", "null"],
            "minimum": 0,
            "description": "how many top logprobs each token gets",
        },  # fmt: skip
        echo={
            "type": ["boolean", "null"],
            "description": "the prompt before the completion, with its tokens' logprobs when "
            "logprobs is given (max_tokens may then be 0)",
        },
    )
    return _object(properties, COMPLETION_FIELDS, ["model", "prompt"])


def generate_request() -> dict[str, Any]:
    sampling = {
        "type": ["object", "null"],
        "properties": _sampling_properties(),
        "additionalProperties": False,
    }
    properties = {
        "text": {"type": "string"},
        "input_ids": TOKEN_IDS,
        "sampling_params": sampling,
        "stream": {"type": ["boolean", "null"]},
        "model": {"type": ["string", "null"]},
        "return_prompt_logprobs": {
            "type": ["boolean", "null"],
            "description": "meta_info.input_token_logprobs: each prompt token's logprob",
        },
    }
    schema = _object(properties, GENERATE_FIELDS, [])
    schema["oneOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]
    return schema


def _object(properties: dict[str, Any], fields: set[str], required: list[str]) -> dict[str, Any]:
    assert set(properties) == set(fields), set(properties) ^ set(fields)
    return {
        "type": "object",
        "required": required,
        "properties": dict(sorted(properties.items())),
        "additionalProperties": False,
    }
