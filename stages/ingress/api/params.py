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
from dataclasses import field as dataclass_field
from typing import Any

from jobs.field_error import FieldError
from jobs.grammar import compile_async, grammar_field
from jobs.protocol import MAX_TOKEN_ID, GenerateRequest
from jobs.request_bounds import request_bounds
from jobs.requests import lift_priority
from jobs.sampling_checks import SEED_LIMIT
from jobs.sampling_params import FIELD_NAMES, SAMPLING_FIELDS, Param, wire_sampling
from stages.ingress.api import response_format, tool_request
from stages.ingress.api.tool_request import ToolCalling
from stages.ingress.body import BOOL, INT, OBJECT, STR, field, int_list, reject_unknown, wrong_type
from stages.ingress.errors import ApiError, in_request_words

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}  # fmt: skip

# OpenAI (and vLLM-extension) request name -> its sampling parameter, for both OpenAI endpoints.
OPENAI_SAMPLING: dict[str, Param] = {name: p for p in SAMPLING_FIELDS for name in p.openai}
OPENAI_COMMON = {*OPENAI_SAMPLING, "model", "n", "stream", "stream_options", "user", "logprobs",
                 response_format.NAME}  # fmt: skip
CHAT_FIELDS = {*OPENAI_COMMON, "messages", "top_logprobs", *tool_request.FIELDS}
COMPLETION_FIELDS = {*OPENAI_COMMON, "prompt", "echo"}
# include_obfuscation: OpenAI's padding of stream events against length side channels; none
# is added here, so only false (or nothing) is accepted.
STREAM_OPTIONS = {"include_usage", "resumable", "include_obfuscation"}
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream", "model",
                   "return_prompt_logprobs"}  # fmt: skip


@dataclass
class ApiRequest:
    """What one HTTP request asks for: ``n`` choices of each prompt."""

    prompts: list[dict[str, Any]]  # each: GenerateRequest's prompt, messages or input_ids
    # SamplingParams fields in wire form; `requests` puts `priority` beside them in each job.
    sampling: dict[str, Any]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    resumable: bool | None = None  # stream_options.resumable: event ids (streaming/resume.py)
    tools: ToolCalling | None = None  # a chat's tool calling, when it may call tools
    echo: bool = False  # completions: the prompt comes back before each choice's text
    # OpenAI's answers: text, and usage from the Finish. Without logprobs its jobs ask for
    # deltas that count their tokens rather than list them (jobs/requests.py's text_only).
    text_only: bool = False
    # A sampling field -> its name in this request (max_new_tokens -> max_tokens, ...).
    names: dict[str, str] = dataclass_field(default_factory=dict)

    async def compile_grammar(self) -> None:
        """Compile the request's grammar, if any, off the event loop and within the compile
        deadline (jobs/grammar.py); a 400 naming the request's field if it cannot be."""
        name = grammar_field(self.sampling)
        if name is not None:
            try:
                await compile_async(name, self.sampling[name])
            except FieldError as exc:
                raise field_error(exc, self.names) from None

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
        `tenant` with its `weight` (stages/ingress/tenancy/tenants.py)."""
        created = time.time()
        rids = self.rids(request_id)
        out = []
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                # The priority travels beside the sampling parameters (jobs/requests.py).
                sampling, priority = lift_priority(self.sampling)
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
                        priority=priority,
                        bundle_replies=True,  # its reply reader reads TextDeltas
                        text_only=(self.text_only and not self.logprobs) or None,
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
    if grammar_field(sampling) is None:  # auto beside response_format: the format's grammar
        sampling["ebnf"] = tools.grammar()  # calls (or, with auto, text or calls)
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
    job.names["input_ids"] = "prompt"  # its token ids, refused downstream (past the context)
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
    checked = [(p, field(given, p.name, *p.kind.json)) for p in SAMPLING_FIELDS]
    # As SGLang's /generate: top_k -1 (its default) is no top-k, null here.
    sampling = {p.name: v for p, v in checked if v is not None and v != p.off_value}
    if field(data, "return_prompt_logprobs", BOOL):
        sampling["prompt_logprobs"] = True
    stream = bool(field(data, "stream", BOOL))
    names = {} if "prompt_logprobs" in given else {"prompt_logprobs": "return_prompt_logprobs"}
    check_prompt_size([prompt], 1, "text" if text is not None else "input_ids")
    return ApiRequest([prompt], _checked(sampling, names), stream=stream, names=names)


def openai_sampling(data: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters of either OpenAI endpoint's body, by their parameter names."""
    sampling: dict[str, Any] = {}
    schema = response_format.response_schema(data)
    if schema is not None:
        sampling["json_schema"] = schema
    for name, param in OPENAI_SAMPLING.items():
        if name not in data:
            continue  # most are (field would say None): a request names a few of ~30
        value = field(data, name, *param.kind.json)
        if value is not None:
            # A value that means null: vLLM's top_k: -1 is no top-k.
            sampling[param.name] = None if value == param.off_value else value
    return sampling


def _job(data: dict[str, Any], prompts: list[dict[str, Any]], sampling: dict) -> ApiRequest:
    n = field(data, "n", INT)
    n = 1 if n is None else n
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}", param="n", code="invalid_value")
    max_choices = request_bounds().max_choices
    if n * len(prompts) > max_choices:
        raise ApiError(
            400,
            f"at most {max_choices} choices per request (prompts x n), got {n * len(prompts)}",
            param="n",
            code="invalid_value",
        )
    check_prompt_size(prompts, n, "messages" if "messages" in data else "prompt")
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
    options = options or {}
    reject_unknown(options, STREAM_OPTIONS, where="in stream_options: ")
    include_usage = bool(
        field(options, "include_usage", BOOL, label="stream_options.include_usage")
    )
    label = "stream_options.include_obfuscation"
    if field(options, "include_obfuscation", BOOL, label=label):
        raise ApiError(400, f"{label}: true is not supported: events carry no obfuscation "
                       "padding (send false or leave it out)", param=label,
                       code="unsupported_value")  # fmt: skip
    resumable = field(options, "resumable", BOOL, label="stream_options.resumable")
    field(data, "user", STR)
    openai_names = {param.name: name for name, param in OPENAI_SAMPLING.items() if name in data}
    openai_names["json_schema"] = response_format.NAME
    openai_names["ebnf"] = "tools"  # only a chat's tool grammar comes as ebnf
    openai_names["prompt_logprobs"] = "echo"
    if "logprobs" in sampling:
        openai_names.setdefault("logprobs", "logprobs")
        openai_names["top_logprobs"] = "top_logprobs" if "top_logprobs" in data else "logprobs"
    wire = _checked(sampling, openai_names)
    return ApiRequest(prompts, wire, n, stream, include_usage, resumable, names=openai_names,
                      text_only=True)  # fmt: skip


def _checked(sampling: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`sampling` in wire form; a bad value is a 400 naming the request's own field. The
    grammar is compiled later, off the event loop (`ApiRequest.compile_grammar`)."""
    try:
        return wire_sampling(sampling, compile_grammar=False)
    except FieldError as exc:
        raise field_error(exc, names) from None


def field_error(exc: FieldError, names: dict[str, str]) -> ApiError:
    """A 400 for `exc`, naming its field as the request does."""
    error = ApiError(400, str(exc), param=exc.field, code=exc.code or "invalid_value")
    return in_request_words(error, names)


def check_prompt_size(prompts: list[dict[str, Any]], n: int, param: str) -> None:
    """n x the prompts' size within its bound: the prefill work one request can ask for.
    Token ids count one each; text counts its UTF-8 bytes, which a byte-level tokenizer's
    tokens never outnumber (the tokenizer stage checks each prompt's tokens against the
    context)."""
    limit = request_bounds().max_request_prompt_tokens
    size = n * sum(_prompt_size(prompt) for prompt in prompts)
    if size > limit:
        raise ApiError(
            400,
            f"{param}: n x the prompts' size is {size} tokens (a text counts its UTF-8 bytes), "
            f"more than the {limit} one request may ask for",
            param=param,
            code="invalid_value",
        )


def _prompt_size(prompt: dict[str, Any]) -> int:
    if prompt.get("input_ids") is not None:
        return len(prompt["input_ids"])
    if prompt.get("prompt") is not None:
        return len(prompt["prompt"].encode("utf-8", "surrogatepass"))
    return sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in prompt["messages"])


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
        if message.get("content") is None and role != "assistant":  # a reply may be calls alone
            raise ApiError(400, f"{where}.content is required for a {role} message",
                           param="messages", code="missing_field")  # fmt: skip
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
