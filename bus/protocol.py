"""The wire protocol: one msgpack map per stream entry, one typed message per kind.

Every entry on every stream has a single field, ``m``, holding a msgpack map whose ``kind``
names the message type. Token ids travel as packed little-endian int32 bytes (``pack_ids``),
never as lists of Python ints. ``decode`` checks every field's type and raises
`ProtocolError` with the reason, which the actor runtime writes to the dead-letter stream.

Streams (names from ``BusConfig``; ``<p>`` is the prefix, ``streamserve`` by default):

  <p>:requests       GenerateRequest   text, chat or token-id jobs; read by the tokenizer
  <p>:tokenized      TokenizedRequest  token-id jobs; read by the router
  <p>:worker:<id>    TokenizedRequest  routed jobs, and Abort; read by that worker
                     | Abort
  <p>:tokens         TokenBatch        one per engine step; read by the detokenizer
  <p>:reply:<id>     TextDelta         what the request's ``reply_to`` names
                     | ErrorReply
  <p>:dead-letter    (fields: source, entry_id, reason, payload)

A job's ``sampling`` map holds `bus.sampling_params.SamplingParams` fields; a missing
``max_new_tokens`` means "up to the context length", as OpenAI's missing ``max_tokens`` does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

ENTRY_FIELD = b"m"
_ID_DTYPE = np.dtype("<i4")
# A token id is an int32 on the wire; vocabularies are far below this.
MAX_TOKEN_ID = 2**31 - 1
# Prompt tokens decoded as context for the first output tokens (vLLM and SGLang use 5).
PROMPT_CONTEXT_TOKENS = 5


class ProtocolError(ValueError):
    """An entry that is not a well-formed message of the kind expected."""


def pack_ids(ids: list[int] | tuple[int, ...]) -> bytes:
    return np.asarray(ids, dtype=_ID_DTYPE).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    if len(data) % _ID_DTYPE.itemsize:
        raise ProtocolError(f"packed token ids: {len(data)} bytes is not a multiple of 4")
    return np.frombuffer(data, dtype=_ID_DTYPE).tolist()


# ---- field checks ----------------------------------------------------------------------------
# Each message class lists its fields' wire kinds; `decode` checks them, `encode` packs them.

_STR, _INT, _FLOAT, _BOOL, _MAP, _LIST, _IDS = "str", "int", "float", "bool", "map", "list", "ids"


def _check(kind: str, name: str, value: Any, optional: bool) -> Any:
    if value is None:
        if optional:
            return None
        raise ProtocolError(f"field {name!r} is missing")
    ok = {
        _STR: lambda v: isinstance(v, str),
        _INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
        _FLOAT: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        _BOOL: lambda v: isinstance(v, bool),
        _MAP: lambda v: isinstance(v, dict),
        _LIST: lambda v: isinstance(v, list),
        _IDS: lambda v: isinstance(v, bytes),
    }[kind](value)
    if not ok:
        raise ProtocolError(f"field {name!r} must be {kind}, got {type(value).__name__}")
    if kind == _FLOAT:
        value = float(value)
        if not math.isfinite(value):
            raise ProtocolError(f"field {name!r} must be finite")
    if kind == _IDS:
        value = unpack_ids(value)
    return value


class Message:
    """Base of the message dataclasses: ``KIND`` on the wire, ``FIELDS`` name -> wire kind."""

    KIND: ClassVar[str]
    FIELDS: ClassVar[dict[str, str]]
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.KIND}
        for name, kind in self.FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if kind == _IDS:
                value = pack_ids(value)
            elif kind == _LIST and value and isinstance(value[0], Message):
                value = [item.to_wire() for item in value]
            out[name] = value
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Message:
        values = {
            name: _check(kind, name, data.get(name), name in cls.OPTIONAL)
            for name, kind in cls.FIELDS.items()
        }
        return cls(**values)


@dataclass
class GenerateRequest(Message):
    """A job in text (``prompt``), chat (``messages``) or token-id (``input_ids``) form."""

    KIND = "generate"
    FIELDS = {
        "rid": _STR, "reply_to": _STR, "prompt": _STR, "messages": _LIST, "input_ids": _IDS,
        "sampling": _MAP, "created": _FLOAT,
    }  # fmt: skip
    OPTIONAL = frozenset({"prompt", "messages", "input_ids", "created"})

    rid: str
    reply_to: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    created: float | None = None  # unix time the job entered the system, for latency figures

    def __post_init__(self) -> None:
        given = [n for n in ("prompt", "messages", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ProtocolError(
                f"a generate job needs exactly one of prompt, messages, input_ids; got {given}"
            )


@dataclass
class TokenizedRequest(Message):
    KIND = "tokenized"
    FIELDS = {
        "rid": _STR, "reply_to": _STR, "input_ids": _IDS, "sampling": _MAP, "created": _FLOAT,
    }  # fmt: skip
    OPTIONAL = frozenset({"created"})

    rid: str
    reply_to: str
    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    created: float | None = None


@dataclass
class Abort(Message):
    KIND = "abort"
    FIELDS = {"rid": _STR}

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

    def to_wire(self) -> list[Any]:
        wire = [
            self.reason, self.matched, self.prompt_tokens, self.completion_tokens,
            self.cached_tokens,
        ]  # fmt: skip
        if self.draft_tokens:  # without speculation, the 5 fields older readers expect
            wire += [self.draft_tokens, self.accepted_draft_tokens]
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> Finish:
        if not isinstance(data, list) or len(data) not in (5, 7):
            raise ProtocolError("field 'finish' must be a list of 5 or 7")
        reason, matched, *counts = data
        _check(_STR, "finish.reason", reason, optional=False)
        if matched is not None and not isinstance(matched, (str, int)):
            raise ProtocolError("field 'finish.matched' must be str, int or nil")
        names = ("prompt", "completion", "cached", "draft", "accepted_draft")
        for name, value in zip(names, counts, strict=False):
            _check(_INT, f"finish.{name}_tokens", value, optional=False)
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

    def to_wire(self) -> list[Any]:
        return [
            self.rid, self.reply_to, self.start, pack_ids(self.ids), pack_ids(self.context),
            self.prompt_context, self.stop, self.skip_special_tokens,
            None if self.finish is None else self.finish.to_wire(),
            self.logprobs, self.top_logprobs,
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, data: Any) -> TokenItem:
        if not isinstance(data, list) or len(data) != 11:
            raise ProtocolError("a token item must be a list of 11")
        rid, reply_to, start, ids, context, prompt_context, stop, skip, finish, lps, tops = data
        _check(_STR, "rid", rid, False)
        _check(_STR, "reply_to", reply_to, False)
        _check(_INT, "start", start, False)
        _check(_INT, "prompt_context", prompt_context, False)
        _check(_BOOL, "skip_special_tokens", skip, False)
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ProtocolError("field 'stop' must be a list of strings")
        if lps is not None and not isinstance(lps, list):
            raise ProtocolError("field 'logprobs' must be a list")
        if tops is not None and not isinstance(tops, list):
            raise ProtocolError("field 'top_logprobs' must be a list")
        item = cls(
            rid, reply_to, start, _check(_IDS, "ids", ids, False),
            _check(_IDS, "context", context, False), prompt_context, stop, skip,
            None if finish is None else Finish.from_wire(finish), lps, tops,
        )  # fmt: skip
        if not 0 <= item.prompt_context <= len(item.context):
            raise ProtocolError("field 'prompt_context' exceeds the context")
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
    FIELDS = {"worker_id": _STR, "step": _INT, "items": _LIST}

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
        "rid": _STR, "seq": _INT, "ids": _IDS, "text": _STR, "finish": _LIST,
        "logprobs": _LIST, "top_logprobs": _LIST, "token_texts": _LIST,
        "top_token_texts": _LIST,
    }  # fmt: skip
    OPTIONAL = frozenset(
        {"text", "finish", "logprobs", "top_logprobs", "token_texts", "top_token_texts"}
    )

    rid: str
    seq: int
    ids: list[int]
    text: str | None = None
    finish: list[Any] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    token_texts: list[str] | None = None  # each token's own text, when logprobs are asked
    top_token_texts: list[list[str]] | None = None  # the texts of top_logprobs' ids

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
    FIELDS = {"rid": _STR, "status": _INT, "message": _STR, "type": _STR, "param": _STR,
              "code": _STR}  # fmt: skip
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
        "worker_id": _STR, "stream": _STR, "model": _STR, "running": _INT, "waiting": _INT,
        "free_kv_tokens": _INT, "total_kv_tokens": _INT, "admitted": _INT, "time": _FLOAT,
        "attention": _STR,
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


def encode(message: Message) -> bytes:
    return msgpack.packb(message.to_wire(), use_bin_type=True)


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
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed {kind}: {exc}") from None


def fields_of(message: Message) -> dict[str, Any]:
    """The message's fields as a plain dict (for logs and tests)."""
    return dataclasses.asdict(message)
