"""The wire protocol: one msgpack map per stream entry, one typed message per kind.

Every entry on every stream has a single field, ``m``, holding a msgpack map whose ``kind``
names the message type (the codec, with its field checks, is jobs/wire.py). ``decode`` takes
an entry's payload to one of the kinds a stream accepts, or raises `ProtocolError` with the
reason, which the stages write to the dead-letter stream.

Streams (names from ``BusConfig``; ``<p>`` is the prefix, ``streamserve`` by default):

  <p>:requests       GenerateRequest   text, chat or token-id jobs; read by the tokenizer
  <p>:tokenized      TokenizedRequest  token-id jobs; read by the router
  <p>:worker:<id>    TokenizedRequest  routed jobs (one bundle entry per router batch for
                     | Abort           a worker that reads bundles), and aborts; read by
                                       that worker
  <p>:tokens         TokenBatch        what older workers publish, and a word that a log
                                       opened; read by the detokenizers
  <p>:reply:<id>     TextDelta         what the request's ``reply_to`` names; TextDeltas
                     | TextDeltas      bundles the deltas of one detokenizer batch for the
                     | ErrorReply      jobs that asked for it (``bundle_replies``)
  <p>:progress:<id>  ProgressEntry     a worker's progress log (jobs/progress.py), each
                     + TokenBatch      entry with its publish's TokenBatch (field ``t``);
                                       read by the detokenizers too
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

from jobs.heartbeat import Heartbeat
from jobs.kv_events import KvEvents
from jobs.progress import ProgressEntry
from jobs.requests import MAX_TAG, Abort, GenerateRequest, TokenizedRequest, check_tag
from jobs.token_batch import TokenBatch
from jobs.token_records import PROMPT_CONTEXT_TOKENS, Finish, TokenItem, check_floats, token_context

# The codec's names are the protocol's too: an importer of messages needs no second import.
from jobs.wire import (
    BYTES,
    DEFLATED_MARK,
    ENTRY_FIELD,
    IDS,
    INT,
    JOBS_FIELD,
    LIST,
    MAX_TOKEN_ID,
    RECORD,
    STR,
    TOKENS_FIELD,
    WIRE_VERSION,
    Message,
    ProtocolError,
    bundle_payloads,
    encode,
    ext_type,
    fields_of,
    inflate,
    job_entries,
    job_payloads,
    pack_ids,
    pack_ids_narrow,
    unpack_ids,
)

__all__ = [
    "ENTRY_FIELD", "JOBS_FIELD", "TOKENS_FIELD", "MAX_TOKEN_ID", "PROMPT_CONTEXT_TOKENS",
    "MESSAGE_TYPES", "Message", "ProtocolError", "GenerateRequest", "TokenizedRequest", "Abort",
    "Finish", "TokenItem", "TokenBatch", "TextDelta", "TextDeltas", "ErrorReply", "ProgressEntry",
    "KvEvents", "Heartbeat", "bundle_payloads", "decode", "encode", "fields_of", "job_entries",
    "job_payloads", "pack_ids", "pack_ids_narrow", "token_context", "unpack_ids", "WIRE_VERSION",
]  # fmt: skip


@dataclass
class TextDelta(Message):
    """What a request gained: tokens ``seq`` .. ``seq + len(ids)`` of its output and their text.

    Deltas of one request may arrive out of order (detokenizer replicas race); a reader
    orders them by ``seq``. In a TextDeltas entry, a delta of a job with a ``tag``
    (jobs/requests.py) is named by it, and by its ``rid`` too only at ``seq`` 0; read back
    without one, ``rid`` is None until its reader names it (bus/replies.py). In a TextDeltas
    entry, a delta of a ``text_only`` job (jobs/requests.py) carries ``n``, how many tokens
    it adds, in place of its ``ids`` (then empty): `count` is either. ``text`` is None
    when the model has no tokenizer. The last delta carries ``finish`` in the wire version of
    the job's requester: a map by name (`Finish.to_wire`) for version 2, the positional list
    of jobs/legacy_records.py for a job written without a version.
    """

    KIND = "delta"
    FIELDS = {
        "rid": STR, "seq": INT, "ids": IDS, "text": STR, "finish": RECORD,
        "logprobs": LIST, "top_logprobs": LIST, "token_texts": LIST,
        "top_token_texts": LIST, "prompt_ids": IDS, "prompt_text": STR,
        "prompt_logprobs": LIST, "prompt_top_logprobs": LIST, "prompt_token_texts": LIST,
        "prompt_top_token_texts": LIST, "embedding": BYTES, "weights_version": STR,
        "tag": INT, "worker": STR, "n": INT,
    }  # fmt: skip
    OPTIONAL = frozenset(FIELDS) - {"rid", "seq", "ids"}

    rid: str | None  # None: named by its tag alone, in a TextDeltas entry
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
    # The weights computing the request, on its first delta (its TokenBatch's `weights`), so
    # a stream names them from its first chunk; its Finish names them again.
    weights_version: str | None = None
    tag: int | None = None  # its job's, in a TextDeltas entry
    # The worker computing the request, on its first delta (its TokenBatch's `worker_id`):
    # the ingress serving it sends an abort straight to that worker's stream.
    worker: str | None = None
    n: int | None = None  # a text_only job's count of the tokens it adds; None: see ids

    @property
    def count(self) -> int:
        """How many output tokens it adds: its ids, or the count standing for them."""
        return len(self.ids) if self.n is None else self.n

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.KIND, **self.fields_wire()}

    def fields_wire(self, narrow: bool = False) -> dict[str, Any]:
        """Its map less ``kind`` (what a TextDeltas entry holds). Written field by field, not
        through Record's loop over all 20: a detokenizer writes one per request per publish,
        and most carry four. `narrow`: its ids packed as `pack_ids_narrow` does (in a
        TextDeltas, which only this project's readers take); else int32, as a program that
        reads its own reply stream has always had them."""
        pack = pack_ids_narrow if narrow else pack_ids
        wire: dict[str, Any] = {"seq": self.seq}
        if self.n is not None and narrow:
            wire["n"] = self.n
        else:
            wire["ids"] = pack(self.ids)
        if narrow and self.tag is not None:
            wire["tag"] = self.tag
            if self.seq == 0:  # a request's first delta names it both ways
                wire["rid"] = self.rid
        else:
            wire["rid"] = self.rid
        if self.text is not None:
            wire["text"] = self.text
        if self.finish is not None:
            wire["finish"] = self.finish
        for name in _DELTA_EXTRAS:
            value = getattr(self, name)
            if value is not None:
                wire[name] = pack(value) if name in _DELTA_IDS else value
        return wire

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TextDelta:
        # Nearly every delta is rid, seq, ids and text, well formed: read those directly (an
        # ingress reads one per request per publish). Anything else, or any field of the
        # wrong kind, goes through Record's checks, which name what is wrong.
        text, rid, tag, n = data.get("text"), data.get("rid"), data.get("tag"), data.get("n")
        if (
            data.keys() <= _DELTA_COMMON
            and (type(rid) is str or (rid is None and type(tag) is int))
            and (tag is None or (type(tag) is int and 0 <= tag <= MAX_TAG))
            and type(data.get("seq")) is int
            and (type(data.get("ids")) in _PACKED_IDS if n is None
                 else type(n) is int and 0 <= n <= MAX_COUNT and "ids" not in data)
            and (text is None or type(text) is str)
        ):  # fmt: skip
            ids = unpack_ids(data["ids"]) if n is None else []
            delta = cls(rid, data["seq"], ids, text, data.get("finish"))
            delta.tag, delta.n = tag, n
        else:
            defaults = {"rid": None} if "rid" not in data and "tag" in data else None
            if "n" in data and "ids" not in data:
                defaults = {**(defaults or {}), "ids": []}
            delta = super().from_wire(data, defaults)
            check_tag(delta.tag)
            if delta.rid is None and delta.tag is None:
                raise ProtocolError("field 'rid' is missing")
            if delta.n is not None and (delta.ids or not 0 <= delta.n <= MAX_COUNT):
                raise ProtocolError(f"field 'n' must be 0 to {MAX_COUNT}, in place of 'ids'")
        if delta.finish is not None:
            # Checked here, not where a reader trips on it; kept for finish_info.
            delta._read_finish = (delta.finish, Finish.from_wire(delta.finish))
        check_floats("embedding", delta.embedding)
        return delta

    def failure(self) -> ErrorReply | None:
        """The ErrorReply a last delta whose Finish is an error stands for; else None."""
        finish = self.finish_info()
        if finish is None or finish.reason != "error":
            return None
        assert self.rid is not None  # a reader names its deltas before it reads their ends
        return ErrorReply(self.rid, 400, str(finish.matched or "the request failed"),
                          param=finish.param)  # fmt: skip

    def finish_info(self) -> Finish | None:
        """Its ``finish`` as a Finish (read once per delta: a reader asks several times)."""
        if self.finish is None:
            return None
        read = self.__dict__.get("_read_finish")
        if read is None or read[0] is not self.finish:  # none read, or finish replaced since
            read = self._read_finish = (self.finish, Finish.from_wire(self.finish))
        return read[1]


_PACKED_IDS = (bytes, msgpack.ExtType)  # int32 bytes, or uint16s (jobs/wire.py)
# A delta's fields past those of nearly every one: logprobs and the prompt's, asked for.
_DELTA_COMMON = frozenset({"kind", "rid", "seq", "ids", "text", "finish", "tag", "n"})
MAX_COUNT = 2**31 - 1  # the most tokens one delta counts (``n``): far beyond any output
_DELTA_EXTRAS = tuple(name for name in TextDelta.FIELDS if name not in _DELTA_COMMON)
_DELTA_IDS = frozenset(name for name in _DELTA_EXTRAS if TextDelta.FIELDS[name] == IDS)


@dataclass
class TextDeltas(Message):
    """The deltas of one detokenizer batch bound to one reply stream, in one entry: for jobs
    whose requester asked for it (``bundle_replies``), so a reply stream costs one XADD per
    batch, not one per request per publish. Each delta is a TextDelta's map, less its kind."""

    KIND = "deltas"
    COMPRESSIBLE = True
    FIELDS = {"deltas": LIST}

    deltas: list[TextDelta]  # read with `decode`'s ``plain``: the maps of plain ones too

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.KIND,
                "deltas": [delta.fields_wire(narrow=True) for delta in self.deltas]}  # fmt: skip

    @classmethod
    def from_wire(cls, data: dict[str, Any], plain: bool = False) -> TextDeltas:
        bundle = super().from_wire(data)
        if not all(isinstance(delta, dict) for delta in bundle.deltas):
            raise ProtocolError("field 'deltas' must be a list of maps")
        if plain:
            bundle.deltas = [d if is_plain(d) else TextDelta.from_wire(d) for d in bundle.deltas]
        else:
            bundle.deltas = [TextDelta.from_wire(delta) for delta in bundle.deltas]
        return bundle


def is_plain(delta: dict[str, Any]) -> bool:
    """Whether a bundled delta's map is its text and how many tokens it adds, nothing else:
    ``tag``, ``seq``, ``n`` (a text_only job's) and ``text``, well formed. Most of a stream
    is these; read with `decode`'s ``plain``, a TextDeltas keeps them as their maps, for a
    reader that relays them from their fields (bus/reply_router.py) with no TextDelta built
    (``TextDelta.from_wire`` builds the one a map stands for)."""
    if not delta.keys() <= _PLAIN_KEYS:
        return False
    tag, seq, n, text = delta.get("tag"), delta.get("seq"), delta.get("n"), delta.get("text")
    return (type(tag) is int and 0 <= tag <= MAX_TAG and type(seq) is int and type(n) is int
            and 0 < n <= MAX_COUNT and (text is None or type(text) is str))  # fmt: skip


_PLAIN_KEYS = frozenset({"tag", "seq", "n", "text"})


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


def decode(payload: bytes | None, *accepted: type[Message], plain: bool = False) -> Message:
    """Parse one entry's payload into one of the ``accepted`` message types; with `plain`, a
    TextDeltas holds the map of each delta that `is_plain`, checked, not a TextDelta."""
    if payload is None:
        raise ProtocolError(f"entry has no {ENTRY_FIELD.decode()!r} field")
    if payload[:1] == DEFLATED_MARK:
        if not any(cls.COMPRESSIBLE for cls in accepted):
            names = ", ".join(c.KIND for c in accepted)
            raise ProtocolError(f"a deflated payload, on a stream whose kinds ({names}) are "
                                "written plain")  # fmt: skip
        payload = inflate(payload)
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=ext_type)
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
        if plain and cls is TextDeltas:
            return TextDeltas.from_wire(data, plain=True)
        return cls.from_wire(data)
    except ProtocolError:
        raise
    except Exception as exc:  # whatever a field makes a check raise is the entry's fault
        raise ProtocolError(f"malformed {kind}: {type(exc).__name__}: {exc}"[:1000]) from None
