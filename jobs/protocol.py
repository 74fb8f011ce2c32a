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
  <p>:reply:<id>     TextDelta         what the request's ``reply_to`` names; TextDeltas
                     | TextDeltas      bundles the deltas of one detokenizer batch for the
                     | ErrorReply      jobs that asked for it (``bundle_replies``)
  <p>:progress:<id>  ProgressEntry     a worker's progress log (jobs/progress.py)
  <p>:kv-events      KvEvents          blocks the workers' prefix caches stored and removed
                                       (jobs/kv_events.py); read by every router replica
  <p>:dead-letter    (fields: source, entry_id, reason, payload)

A job's ``sampling`` map holds `jobs.sampling_params.SamplingParams` fields (``priority``
travels beside it, a job field; jobs/requests.py says how the job versions differ); a missing
``max_new_tokens`` means "up to the context length", as OpenAI's missing ``max_tokens`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from jobs.kv_events import KvEvents
from jobs.progress import ProgressEntry
from jobs.requests import Abort, GenerateRequest, TokenizedRequest
from jobs.token_records import PROMPT_CONTEXT_TOKENS, Finish, TokenItem, check_floats, token_context

# The codec's names are the protocol's too: an importer of messages needs no second import.
from jobs.wire import (
    BYTES,
    DEFLATED_MARK,
    ENTRY_FIELD,
    FLOAT,
    IDS,
    INT,
    LIST,
    MAX_TOKEN_ID,
    RECORD,
    STR,
    WIRE_VERSION,
    Message,
    ProtocolError,
    Record,
    check_version,
    encode,
    fields_of,
    inflate,
    pack_ids,
    unpack_ids,
)

__all__ = [
    "ENTRY_FIELD", "MAX_TOKEN_ID", "PROMPT_CONTEXT_TOKENS", "MESSAGE_TYPES", "Message",
    "ProtocolError", "GenerateRequest", "TokenizedRequest", "Abort", "Finish", "TokenItem",
    "TokenBatch", "TextDelta", "TextDeltas", "ErrorReply", "ProgressEntry", "KvEvents",
    "Heartbeat",
    "decode", "encode", "fields_of", "pack_ids", "token_context", "unpack_ids", "WIRE_VERSION",
]  # fmt: skip


@dataclass
class TokenBatch(Message):
    """Everything one engine step produced, for every request that got a token."""

    KIND = "tokens"
    COMPRESSIBLE = True
    FIELDS = {"worker_id": STR, "step": INT, "items": LIST, "v": INT}
    OPTIONAL = frozenset({"v"})

    worker_id: str
    step: int
    items: list[TokenItem]
    # Its items' wire version: maps by name (2); absent, the lists of older workers (1).
    v: int = WIRE_VERSION

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TokenBatch:
        version = check_version("tokens batch", data.get("v"))
        batch = super().from_wire(data)
        batch.v = version
        batch.items = [TokenItem.from_wire(item) for item in batch.items]
        return batch


@dataclass
class TextDelta(Message):
    """What a request gained: tokens ``seq`` .. ``seq + len(ids)`` of its output and their text.

    Deltas of one request may arrive out of order (detokenizer replicas race); a reader
    orders them by ``seq``. ``text`` is None when the model has no tokenizer. The last delta
    carries ``finish`` in the wire version of the job's requester: a map by name
    (`Finish.to_wire`) for version 2, the positional list of jobs/legacy_records.py for a
    job written without a version.
    """

    KIND = "delta"
    FIELDS = {
        "rid": STR, "seq": INT, "ids": IDS, "text": STR, "finish": RECORD,
        "logprobs": LIST, "top_logprobs": LIST, "token_texts": LIST,
        "top_token_texts": LIST, "prompt_ids": IDS, "prompt_text": STR,
        "prompt_logprobs": LIST, "prompt_top_logprobs": LIST, "prompt_token_texts": LIST,
        "prompt_top_token_texts": LIST, "embedding": BYTES,
    }  # fmt: skip
    OPTIONAL = frozenset(FIELDS) - {"rid", "seq", "ids"}

    rid: str
    seq: int
    ids: list[int]
    text: str | None = None
    finish: dict[str, Any] | list[Any] | None = None
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
    embedding: bytes | None = None  # an embedding job's vector, as its TokenItem's

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TextDelta:
        delta = super().from_wire(data)
        if delta.finish is not None:
            Finish.from_wire(delta.finish)  # checked here, not where a reader trips on it
        check_floats("embedding", delta.embedding)
        return delta

    def finish_info(self) -> Finish | None:
        return None if self.finish is None else Finish.from_wire(self.finish)


@dataclass
class TextDeltas(Message):
    """The deltas of one detokenizer batch bound to one reply stream, in one entry: for jobs
    whose requester asked for it (``bundle_replies``), so a reply stream costs one XADD per
    batch, not one per request per publish. Each delta is a TextDelta's map, less its kind."""

    KIND = "deltas"
    COMPRESSIBLE = True
    FIELDS = {"deltas": LIST}

    deltas: list[TextDelta]

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.KIND, "deltas": [Record.to_wire(delta) for delta in self.deltas]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TextDeltas:
        bundle = super().from_wire(data)
        if not all(isinstance(delta, dict) for delta in bundle.deltas):
            raise ProtocolError("field 'deltas' must be a list of maps")
        bundle.deltas = [TextDelta.from_wire(delta) for delta in bundle.deltas]
        return bundle


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
        TextDeltas,
        ErrorReply,
        Heartbeat,
        ProgressEntry,
        KvEvents,
    )  # fmt: skip
}


def decode(payload: bytes | None, *accepted: type[Message]) -> Message:
    """Parse one entry's payload into one of the ``accepted`` message types."""
    if payload is None:
        raise ProtocolError(f"entry has no {ENTRY_FIELD.decode()!r} field")
    if payload[:1] == DEFLATED_MARK:
        if not any(cls.COMPRESSIBLE for cls in accepted):
            names = ", ".join(c.KIND for c in accepted)
            raise ProtocolError(f"a deflated payload, on a stream whose kinds ({names}) are "
                                "written plain")  # fmt: skip
        payload = inflate(payload)
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
