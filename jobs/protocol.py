"""The wire protocol: one msgpack map per stream entry, one typed message per kind.

Every entry on every stream has a single field, ``m``, holding a msgpack map whose ``kind``
names the message type (the codec, with its field checks, is jobs/wire.py). ``decode`` takes
an entry's payload to one of the kinds a stream accepts, or raises `ProtocolError` with the
reason, which the stages write to the dead-letter stream.

Streams (names from ``BusConfig``; ``<p>`` is the prefix, ``streamserve`` by default):

  <p>:requests       GenerateRequest   text, chat or token-id jobs; read by the tokenizer
  <p>:tokenized      TokenizedRequest  token-id jobs; read by the router
  <p>:worker:<id>    TokenizedRequest  routed jobs, and Abort; read by that worker
                     | Abort
  <p>:tokens         TokenBatch        one per engine step; read by the detokenizer
  <p>:reply:<id>     TextDelta         what the request's ``reply_to`` names
                     | ErrorReply
  <p>:dead-letter    (fields: source, entry_id, reason, payload)

A job's ``sampling`` map holds `jobs.sampling_params.SamplingParams` fields; a missing
``max_new_tokens`` means "up to the context length", as OpenAI's missing ``max_tokens`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

# The codec's names are the protocol's too: an importer of messages needs no second import.
from jobs.wire import (
    BOOL,
    ENTRY_FIELD,
    FLOAT,
    IDS,
    INT,
    LIST,
    MAP,
    MAX_TOKEN_ID,
    STR,
    Message,
    ProtocolError,
    check_field,
    encode,
    fields_of,
    pack_ids,
    unpack_ids,
)  # fmt: skip

__all__ = [
    "ENTRY_FIELD", "MAX_TOKEN_ID", "PROMPT_CONTEXT_TOKENS", "MESSAGE_TYPES", "Message",
    "ProtocolError", "GenerateRequest", "TokenizedRequest", "Abort", "Finish", "TokenItem",
    "TokenBatch", "TextDelta", "ErrorReply", "Heartbeat", "decode", "encode", "fields_of",
    "pack_ids", "token_context", "unpack_ids",
]  # fmt: skip

# Prompt tokens decoded as context for the first output tokens (vLLM and SGLang use 5).
PROMPT_CONTEXT_TOKENS = 5


@dataclass
class GenerateRequest(Message):
    """A job in text (``prompt``), chat (``messages``) or token-id (``input_ids``) form; a chat
    may name ``tools`` (OpenAI's function definitions), which its template renders.
    ``tenant`` and ``weight`` say whose job it is and its share when several tenants wait
    (the ingress sets them from the API key; gpu_worker/scheduling/fair_share.py)."""

    KIND = "generate"
    FIELDS = {
        "rid": STR, "reply_to": STR, "prompt": STR, "messages": LIST, "input_ids": IDS,
        "sampling": MAP, "created": FLOAT, "tools": LIST, "tenant": STR, "weight": FLOAT,
    }  # fmt: skip
    OPTIONAL = frozenset({"prompt", "messages", "input_ids", "created", "tools", "tenant",
                          "weight"})  # fmt: skip

    rid: str
    reply_to: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    created: float | None = None  # unix time the job entered the system, for latency figures
    tools: list[dict[str, Any]] | None = None
    tenant: str | None = None
    weight: float | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("prompt", "messages", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ProtocolError(
                f"a generate job needs exactly one of prompt, messages, input_ids; got {given}"
            )
        if self.tools is not None and self.messages is None:
            raise ProtocolError("tools come with a chat job (messages)")
        _check_weight(self.weight)


@dataclass
class TokenizedRequest(Message):
    """A token-id job. ``attempts`` counts the workers that were handed it and died before
    finishing it (the reaper adds them when it requeues the job; jobs/job_failures.py): past
    ``max_deliveries`` the job is set aside instead of killing another worker."""

    KIND = "tokenized"
    FIELDS = {
        "rid": STR, "reply_to": STR, "input_ids": IDS, "sampling": MAP, "created": FLOAT,
        "tenant": STR, "weight": FLOAT, "attempts": INT,
    }  # fmt: skip
    OPTIONAL = frozenset({"created", "tenant", "weight", "attempts"})

    rid: str
    reply_to: str
    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    created: float | None = None
    tenant: str | None = None  # as the GenerateRequest's
    weight: float | None = None
    attempts: int | None = None

    def __post_init__(self) -> None:
        _check_weight(self.weight)
        if self.attempts is not None and not 0 <= self.attempts < 2**31:
            raise ProtocolError(f"attempts must be a count >= 0; got {self.attempts}")


def _check_weight(weight: float | None) -> None:
    # A share: zero, negative or infinite would stall or starve the tenant's queue.
    if weight is not None and not 0 < weight < float("inf"):
        raise ProtocolError(f"weight must be a positive finite number; got {weight}")


@dataclass
class Abort(Message):
    KIND = "abort"
    FIELDS = {"rid": STR}

    rid: str


@dataclass
class Finish:
    """How a request ended: ``reason`` is stop, length, abort or error."""

    reason: str
    matched: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Speculative decoding: tokens drafted for the request, and how many were accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Seconds from the job's creation to the start of the step that computed its first
    # token (None: not measured, e.g. a job that finished before it ran).
    queue_seconds: float | None = None

    def to_wire(self) -> list[Any]:
        wire = [
            self.reason, self.matched, self.prompt_tokens, self.completion_tokens,
            self.cached_tokens,
        ]  # fmt: skip
        # Without speculation or timing, the 5 fields older readers expect.
        if self.draft_tokens or self.queue_seconds is not None:
            wire += [self.draft_tokens, self.accepted_draft_tokens]
        if self.queue_seconds is not None:
            wire.append(self.queue_seconds)
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> Finish:
        if not isinstance(data, list) or len(data) not in (5, 7, 8):
            raise ProtocolError("field 'finish' must be a list of 5, 7 or 8")
        reason, matched, *counts = data
        check_field(STR, "finish.reason", reason, optional=False)
        if matched is not None and not isinstance(matched, (str, int)):
            raise ProtocolError("field 'finish.matched' must be str, int or nil")
        names = ("prompt", "completion", "cached", "draft", "accepted_draft")
        for name, value in zip(names, counts, strict=False):
            check_field(INT, f"finish.{name}_tokens", value, optional=False)
        if len(counts) == 6 and (
            isinstance(counts[5], bool) or not isinstance(counts[5], (int, float))
        ):
            raise ProtocolError("field 'finish.queue_seconds' must be a number")
        return cls(reason, matched, *counts)

    def usage(self) -> dict[str, int]:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.draft_tokens:
            usage.update(draft_tokens=self.draft_tokens,
                         accepted_draft_tokens=self.accepted_draft_tokens)  # fmt: skip
        return usage


@dataclass
class TokenItem:
    """One request's new tokens in one engine step.

    ``start`` is the output index of ``ids[0]``. ``context`` is the token ids just before
    ``ids`` (the last prompt tokens, then earlier output), of which the first
    ``prompt_context`` are prompt tokens: with them a detokenizer replica that has never seen
    this request turns ``ids`` into exactly the text they add (see
    stages/detokenizer/incremental.py).
    """

    rid: str
    reply_to: str
    start: int
    ids: list[int]
    context: list[int]
    prompt_context: int
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    finish: Finish | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None  # per token: [[id, logprob], ...]
    # The prompt and its logprobs (sampling's prompt_logprobs), on a request's first item:
    # one entry per prompt token, None for the first.
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[list[float]] | None] | None = None

    def to_wire(self) -> list[Any]:
        prompt = None
        if self.prompt_ids is not None:
            prompt = [pack_ids(self.prompt_ids), self.prompt_logprobs, self.prompt_top_logprobs]
        return [
            self.rid, self.reply_to, self.start, pack_ids(self.ids), pack_ids(self.context),
            self.prompt_context, self.stop, self.skip_special_tokens,
            None if self.finish is None else self.finish.to_wire(),
            self.logprobs, self.top_logprobs, prompt,
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, data: Any) -> TokenItem:
        # 11 fields from a worker that predates prompt logprobs (a rolling upgrade).
        if not isinstance(data, list) or len(data) not in (11, 12):
            raise ProtocolError("a token item must be a list of 12")
        prompt = data[11] if len(data) == 12 else None
        rid, reply_to, start, ids, context, prompt_context, stop, skip, finish, lps, tops = data[
            :11
        ]
        check_field(STR, "rid", rid, False)
        check_field(STR, "reply_to", reply_to, False)
        check_field(INT, "start", start, False)
        check_field(INT, "prompt_context", prompt_context, False)
        check_field(BOOL, "skip_special_tokens", skip, False)
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ProtocolError("field 'stop' must be a list of strings")
        if lps is not None and not isinstance(lps, list):
            raise ProtocolError("field 'logprobs' must be a list")
        if tops is not None and not isinstance(tops, list):
            raise ProtocolError("field 'top_logprobs' must be a list")
        item = cls(
            rid, reply_to, start, check_field(IDS, "ids", ids, False),
            check_field(IDS, "context", context, False), prompt_context, stop, skip,
            None if finish is None else Finish.from_wire(finish), lps, tops,
        )  # fmt: skip
        if not 0 <= item.prompt_context <= len(item.context):
            raise ProtocolError("field 'prompt_context' exceeds the context")
        if prompt is not None:
            if not isinstance(prompt, list) or len(prompt) != 3:
                raise ProtocolError("field 'prompt' must be [ids, logprobs, top_logprobs]")
            item.prompt_ids = check_field(IDS, "prompt_ids", prompt[0], False)
            for name, value in (("prompt_logprobs", prompt[1]), ("prompt_top_logprobs", prompt[2])):
                if value is not None and not isinstance(value, list):
                    raise ProtocolError(f"field {name!r} must be a list")
            item.prompt_logprobs, item.prompt_top_logprobs = prompt[1], prompt[2]
        return item


def token_context(
    prompt_ids: list[int], output_ids: list[int], start: int, window: int
) -> tuple[list[int], int]:
    """(context, prompt_context) of a TokenItem whose ids begin at output index `start`.

    Until `window` output tokens exist, the context is the last prompt tokens and all the
    output so far, so the first tokens decode in context and any held-back text is inside;
    after that, the `window` output tokens before `start`.
    """
    if start < window:
        prompt_part = prompt_ids[-PROMPT_CONTEXT_TOKENS:]
        return prompt_part + output_ids[:start], len(prompt_part)
    return output_ids[start - window : start], 0


@dataclass
class TokenBatch(Message):
    """Everything one engine step produced, for every request that got a token."""

    KIND = "tokens"
    FIELDS = {"worker_id": STR, "step": INT, "items": LIST}

    worker_id: str
    step: int
    items: list[TokenItem]

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TokenBatch:
        batch = super().from_wire(data)
        batch.items = [TokenItem.from_wire(item) for item in batch.items]
        return batch

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.KIND, "worker_id": self.worker_id, "step": self.step,
                "items": [item.to_wire() for item in self.items]}  # fmt: skip


@dataclass
class TextDelta(Message):
    """What a request gained: tokens ``seq`` .. ``seq + len(ids)`` of its output and their text.

    Deltas of one request may arrive out of order (detokenizer replicas race); a reader
    orders them by ``seq``. ``text`` is None when the model has no tokenizer. The last delta
    carries ``finish`` (as `Finish.to_wire`).
    """

    KIND = "delta"
    FIELDS = {
        "rid": STR, "seq": INT, "ids": IDS, "text": STR, "finish": LIST,
        "logprobs": LIST, "top_logprobs": LIST, "token_texts": LIST,
        "top_token_texts": LIST, "prompt_ids": IDS, "prompt_text": STR,
        "prompt_logprobs": LIST, "prompt_top_logprobs": LIST, "prompt_token_texts": LIST,
        "prompt_top_token_texts": LIST,
    }  # fmt: skip
    OPTIONAL = frozenset(FIELDS) - {"rid", "seq", "ids"}

    rid: str
    seq: int
    ids: list[int]
    text: str | None = None
    finish: list[Any] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    token_texts: list[str] | None = None  # each token's own text, when logprobs are asked
    top_token_texts: list[list[str]] | None = None  # the texts of top_logprobs' ids
    # The prompt, with its logprobs, on the first delta of a request that asked for them
    # (TokenItem's, and the texts of the prompt and of its tokens).
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[list[float]] | None] | None = None
    prompt_token_texts: list[str] | None = None
    prompt_top_token_texts: list[list[str] | None] | None = None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TextDelta:
        delta = super().from_wire(data)
        if delta.finish is not None:
            Finish.from_wire(delta.finish)  # checked here, not where a reader trips on it
        return delta

    def finish_info(self) -> Finish | None:
        return None if self.finish is None else Finish.from_wire(self.finish)


@dataclass
class ErrorReply(Message):
    """A request that failed: HTTP-like ``status``, OpenAI-style ``type``/``param``/``code``."""

    KIND = "error"
    FIELDS = {"rid": STR, "status": INT, "message": STR, "type": STR, "param": STR,
              "code": STR}  # fmt: skip
    OPTIONAL = frozenset({"param", "code"})

    rid: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


@dataclass
class Heartbeat(Message):
    """A worker's load, stored under its heartbeat key with a TTL (not on a stream)."""

    KIND = "heartbeat"
    FIELDS = {
        "worker_id": STR, "stream": STR, "model": STR, "running": INT, "waiting": INT,
        "free_kv_tokens": INT, "total_kv_tokens": INT, "admitted": INT, "time": FLOAT,
        "attention": STR,
    }  # fmt: skip
    OPTIONAL = frozenset({"attention"})  # workers from before it was added leave it out

    worker_id: str
    stream: str
    model: str
    running: int
    waiting: int
    free_kv_tokens: int
    total_kv_tokens: int
    admitted: int  # jobs read from its stream since it started
    time: float
    # What serves attention, e.g. "flashinfer (self-check passed: ...), CUDA graphs"
    attention: str | None = None


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        GenerateRequest,
        TokenizedRequest,
        Abort,
        TokenBatch,
        TextDelta,
        ErrorReply,
        Heartbeat,
    )  # fmt: skip
}


def decode(payload: bytes | None, *accepted: type[Message]) -> Message:
    """Parse one entry's payload into one of the ``accepted`` message types."""
    if payload is None:
        raise ProtocolError(f"entry has no {ENTRY_FIELD.decode()!r} field")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"payload must be a msgpack map, got {type(data).__name__}")
    kind = data.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None or cls not in accepted:
        names = ", ".join(c.KIND for c in accepted)
        raise ProtocolError(f"unexpected message kind {kind!r} (this stream takes {names})")
    try:
        return cls.from_wire(data)
    except ProtocolError:
        raise
    except Exception as exc:  # whatever a field makes a check raise is the entry's fault
        raise ProtocolError(f"malformed {kind}: {type(exc).__name__}: {exc}"[:1000]) from None
