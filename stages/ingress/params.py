"""Request bodies of /v1/chat/completions, /v1/completions and /generate, checked and turned
into an `ApiRequest`: the prompts, the sampling parameters (SamplingParams names) and how to
answer.

Everything that can be checked without the model is checked here, so a bad request is a 4xx
before anything is queued; what needs the vocabulary or the context length is checked
downstream and comes back as an ErrorReply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bus.protocol import MAX_TOKEN_ID, GenerateRequest
from bus.sampling_checks import SEED_LIMIT
from bus.sampling_params import (
    FIELD_NAMES,
    SAMPLING_FIELDS,
    Param,
    SamplingParamError,
    wire_sampling,
)
from stages.ingress import response_format, tool_request
from stages.ingress.body import (
    BOOL,
    INT,
    OBJECT,
    STR,
    field,
    int_list,
    reject_unknown,
    wrong_type,
)
from stages.ingress.errors import ApiError
from stages.ingress.tool_request import ToolCalling

MAX_CHOICES = 128  # prompts x n of one HTTP request
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}  # fmt: skip

# OpenAI (and vLLM-extension) request name -> its sampling parameter, for both OpenAI endpoints.
OPENAI_SAMPLING: dict[str, Param] = {name: p for p in SAMPLING_FIELDS for name in p.openai}
OPENAI_COMMON = {*OPENAI_SAMPLING, "model", "n", "stream", "stream_options", "user", "logprobs",
                 response_format.NAME}  # fmt: skip
CHAT_FIELDS = {*OPENAI_COMMON, "messages", "top_logprobs", *tool_request.FIELDS}
COMPLETION_FIELDS = {*OPENAI_COMMON, "prompt", "echo"}
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "model",
                   "return_prompt_logprobs"}  # fmt: skip


@dataclass
class ApiRequest:
    """What one HTTP request asks for: ``n`` choices of each prompt."""

    prompts: list[dict[str, Any]]  # each: GenerateRequest's prompt, messages or input_ids
    sampling: dict[str, Any]  # SamplingParams fields, as sent on the wire
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    tools: ToolCalling | None = None  # a chat's tool calling, when it may call tools
    echo: bool = False  # completions: the prompt comes back before each choice's text

    def echo_text(self, choice: int) -> str | None:
        """The prompt choice `choice` echoes, where the request gave it as text."""
        return self.prompts[choice // self.n].get("prompt")

    @property
    def logprobs(self) -> bool:
        return bool(self.sampling.get("logprobs"))

    def rids(self, request_id: str) -> list[str]:
        """The sub-requests' ids, one per choice: ``<request_id>-<choice index>``."""
        return [f"{request_id}-{i}" for i in range(len(self.prompts) * self.n)]

    def requests(
        self, request_id: str, reply_to: str, tenant: str | None = None,
        weight: float | None = None,
    ) -> list[GenerateRequest]:  # fmt: skip
        """One sub-request per choice, rid ``<request_id>-<choice index>``, each for
        `tenant` with its `weight` (stages/ingress/tenants.py)."""
        created = time.time()
        rids = self.rids(request_id)
        out = []
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                sampling = dict(self.sampling)
                if sampling.get("seed") is not None:
                    sampling["seed"] += j  # one seed would give n equal choices
                rid = rids[p * self.n + j]
                out.append(
                    GenerateRequest(
                        rid=rid,
                        reply_to=reply_to,
                        sampling=sampling,
                        created=created,
                        tenant=tenant,
                        weight=weight,
                        **prompt,
                    )
                )
        return out


def check_model(data: dict[str, Any], served: str, required: bool = True) -> None:
    model = field(data, "model", STR)
    if model is None:
        if required:
            raise ApiError(400, "model is required", param="model", code="missing_field")
        return
    if model != served:
        raise ApiError(
            404,
            f"The model `{model}` does not exist (this server serves `{served}`).",
            param="model",
            code="model_not_found",
        )


def parse_chat(data: dict[str, Any], served: str) -> ApiRequest:
    reject_unknown(data, CHAT_FIELDS)
    check_model(data, served)
    if "messages" not in data:
        raise ApiError(400, "messages is required", param="messages", code="missing_field")
    messages = chat_messages(data["messages"])
    sampling = openai_sampling(data)
    logprobs = field(data, "logprobs", BOOL)
    top = field(data, "top_logprobs", INT)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    if top is not None:
        sampling["top_logprobs"] = top
    tools = tool_request.tool_calling(data)
    if tools is None:
        return _job(data, [{"messages": messages}], sampling)
    grammar = tools.grammar()
    if grammar is not None:
        sampling["ebnf"] = grammar  # the answer must be calls
    job = _job(data, [{"messages": messages, "tools": tools.tools}], sampling)
    job.tools = tools
    return job


def parse_completion(data: dict[str, Any], served: str) -> ApiRequest:
    reject_unknown(data, COMPLETION_FIELDS)
    check_model(data, served)
    if "prompt" not in data:
        raise ApiError(400, "prompt is required", param="prompt", code="missing_field")
    sampling = openai_sampling(data)
    top = field(data, "logprobs", INT)
    if top is not None:  # completions' logprobs is the number of top logprobs wanted
        sampling["logprobs"] = True
        sampling["top_logprobs"] = top
    echo = bool(field(data, "echo", BOOL))
    if echo:  # the prompt's tokens come back from the worker, with their logprobs
        sampling["prompt_logprobs"] = True
    job = _job(data, completion_prompts(data["prompt"]), sampling)
    job.echo = echo
    return job


def parse_generate(data: dict[str, Any], served: str) -> ApiRequest:
    reject_unknown(data, GENERATE_FIELDS)
    check_model(data, served, required=False)
    text = field(data, "text", STR)
    ids = data.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(
            400, "give exactly one of text and input_ids", param="text", code="invalid_value"
        )
    prompt = {"prompt": text} if text is not None else {"input_ids": token_ids(ids, "input_ids")}
    given = field(data, "sampling_params", OBJECT) or {}
    reject_unknown(given, FIELD_NAMES, where="in sampling_params: ")
    checked = {p.name: field(given, p.name, *p.kind.json) for p in SAMPLING_FIELDS}
    sampling = {name: value for name, value in checked.items() if value is not None}
    if field(data, "return_prompt_logprobs", BOOL):
        sampling["prompt_logprobs"] = True
    stream = bool(field(data, "stream", BOOL))
    names = {} if "prompt_logprobs" in given else {"prompt_logprobs": "return_prompt_logprobs"}
    return ApiRequest([prompt], _checked(sampling, names), stream=stream)


def openai_sampling(data: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters of either OpenAI endpoint's body, by their parameter names."""
    sampling: dict[str, Any] = {}
    schema = response_format.response_schema(data)
    if schema is not None:
        sampling["json_schema"] = schema
    for name, param in OPENAI_SAMPLING.items():
        value = field(data, name, *param.kind.json)
        if value is not None:
            # A value that means null: vLLM's top_k: -1 is no top-k.
            sampling[param.name] = None if value == param.openai_off else value
    return sampling


def _job(data: dict[str, Any], prompts: list[dict[str, Any]], sampling: dict) -> ApiRequest:
    n = field(data, "n", INT)
    n = 1 if n is None else n
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}", param="n", code="invalid_value")
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(
            400,
            f"at most {MAX_CHOICES} choices per request (prompts x n), got {n * len(prompts)}",
            param="n",
            code="invalid_value",
        )
    seed = sampling.get("seed")
    if isinstance(seed, int) and not seed + n - 1 < SEED_LIMIT:
        raise ApiError(
            400,
            f"seed + n - 1 must be below 2**63, got seed {seed}",
            param="seed",
            code="invalid_value",
        )
    stream = bool(field(data, "stream", BOOL))
    options = field(data, "stream_options", OBJECT)
    if options is not None and not stream:
        raise ApiError(
            400,
            "stream_options is only allowed when stream is true",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = bool(
        field(options or {}, "include_usage", BOOL, label="stream_options.include_usage")
    )
    field(data, "user", STR)
    openai_names = {param.name: name for name, param in OPENAI_SAMPLING.items() if name in data}
    openai_names["json_schema"] = response_format.NAME
    openai_names["ebnf"] = "tools"  # only a chat's tool grammar comes as ebnf
    openai_names["prompt_logprobs"] = "echo"
    if "logprobs" in sampling:
        openai_names.setdefault("logprobs", "logprobs")
        openai_names["top_logprobs"] = "top_logprobs" if "top_logprobs" in data else "logprobs"
    return ApiRequest(prompts, _checked(sampling, openai_names), n, stream, include_usage)


def _checked(sampling: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`sampling` in wire form; a bad value is a 400 naming the request's own field."""
    try:
        return wire_sampling(sampling)
    except SamplingParamError as exc:
        param = names.get(exc.field, exc.field)
        message = str(exc)
        if param != exc.field and message.startswith(exc.field):
            message = param + message[len(exc.field) :]  # in the request's own words
        raise ApiError(400, message, param=param, code="invalid_value") from None


def chat_messages(value: Any) -> list[dict[str, str]]:
    """Messages with their content flattened to a string (text parts only)."""
    if not isinstance(value, list):
        raise wrong_type("messages", value, "an array")
    if not value:
        raise ApiError(400, "messages must not be empty", param="messages", code="invalid_value")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise wrong_type(where, message, "an object")
        role = field(message, "role", STR, label=f"{where}.role")
        if role not in CHAT_ROLES:
            raise ApiError(
                400,
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                param="messages",
                code="invalid_value",
            )
        entry = {"role": CHAT_ROLES[role], "content": _content(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = tool_request.assistant_tool_calls(message, where)
        elif role == "tool":
            entry["tool_call_id"] = tool_request.tool_result_id(message, where)
        out.append(entry)
    return out


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise wrong_type(f"{where}.content", content, "a string or an array of parts")
    texts = []
    for j, part in enumerate(content):
        label = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise wrong_type(label, part, "an object")
        if part.get("type") != "text":
            raise ApiError(
                400,
                f"{label}: only text content parts are supported, got type {part.get('type')!r}",
                param="messages",
                code="unsupported_content",
            )
        text = field(part, "text", STR, label=f"{label}.text")
        texts.append(text or "")
    return "".join(texts)


def completion_prompts(value: Any) -> list[dict[str, Any]]:
    """A string, strings, token ids or lists of token ids: one prompt dict each."""
    if isinstance(value, str):
        return [{"prompt": value}]
    if not isinstance(value, list):
        raise wrong_type("prompt", value, "a string or an array")
    if not value:
        raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if all(isinstance(p, str) for p in value):
        return [{"prompt": p} for p in value]
    if all(isinstance(p, list) for p in value):
        return [{"input_ids": token_ids(p, "prompt")} for p in value]
    return [{"input_ids": token_ids(value, "prompt")}]


def token_ids(value: Any, name: str) -> list[int]:
    ids = int_list(value, name)
    if not ids:
        raise ApiError(400, f"{name} must not be empty", param=name, code="invalid_value")
    bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ApiError(
            400, f"{name}: token id {bad} is out of range", param=name, code="invalid_value"
        )
    return ids
