"""What a worker says of one request in one step: `TokenItem` (its new tokens, with the
context a detokenizer needs) and, on the last, `Finish` (how it ended, with its counts).

Both are records by name (maps; wire version 2, jobs/wire.py): a field is found by its name,
an optional one left out when it holds its default, so a later version adds fields without
moving any. The positional lists of version 1, which older workers send and older clients
read, are jobs/legacy_records.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from jobs.legacy_records import finish_fields_from_list, token_item_fields_from_list
from jobs.requests import check_tag
from jobs.wire import (
    BOOL,
    BYTES,
    FLOAT,
    IDS,
    INT,
    LIST,
    RECORD,
    STR,
    WIRE_VERSION,
    ProtocolError,
    Record,
    check_field,
    pack_ids_narrow,
)

# Prompt tokens decoded as context for the first output tokens (vLLM and SGLang use 5).
PROMPT_CONTEXT_TOKENS = 5
# Finish reasons whose text held back (a possible stop string's start) is not output.
ENDED_SHORT = frozenset({"abort", "error"})


@dataclass
class Finish(Record):
    """How a request ended: ``reason`` is stop, length, abort or error; ``matched`` the stop
    string or token id that ended it, or an abort's or an error's message. An error is the
    request's own fault found as it ran (a grammar past the matcher's limits mid-answer):
    readers answer it as a 400 naming ``param``, the field at fault."""

    FIELDS: ClassVar[dict[str, str]] = {
        "reason": STR, "matched": "str or int", "prompt_tokens": INT, "completion_tokens": INT,
        "cached_tokens": INT, "draft_tokens": INT, "accepted_draft_tokens": INT,
        "queue_seconds": FLOAT, "route_reason": STR, "expected_cached_tokens": INT,
        "weights_version": STR, "worker": STR, "param": STR,
    }  # fmt: skip
    OPTIONAL: ClassVar[frozenset[str]] = frozenset(FIELDS) - {
        "reason", "prompt_tokens", "completion_tokens"
    }  # fmt: skip

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
    # Why the router chose this worker, and the prompt tokens it expected cached here
    # (stages/router/kv_routing.py): beside cached_tokens, what the worker found.
    route_reason: str | None = None
    expected_cached_tokens: int | None = None
    # The weights that computed every token of it (jobs/weights.py): a worker finishes the
    # requests it runs before it swaps weights, so one version computed all of them.
    weights_version: str | None = None
    # The worker that finished it, for a routed job (nothing else records where a job ran).
    worker: str | None = None
    param: str | None = None  # an error's field at fault

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        if not self.draft_tokens:  # no speculation: both read back as their default, 0
            del wire["draft_tokens"], wire["accepted_draft_tokens"]
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> Finish:
        if isinstance(data, list):
            return cls(**finish_fields_from_list(data))
        if not isinstance(data, dict):
            raise ProtocolError("field 'finish' must be a map")
        matched = data.get("matched")
        if matched is not None and (
            isinstance(matched, bool) or not isinstance(matched, (str, int))
        ):
            raise ProtocolError("field 'finish.matched' must be str, int or nil")
        values = {"matched": matched}
        for name, kind in cls.FIELDS.items():
            if name != "matched":
                value = check_field(kind, f"finish.{name}", data.get(name), name in cls.OPTIONAL)
                if value is not None:
                    values[name] = value
        return cls(**values)

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
        if self.route_reason is not None:
            usage.update(route_reason=self.route_reason,
                         expected_cached_tokens=self.expected_cached_tokens or 0)  # fmt: skip
            if self.worker is not None:
                usage.update(worker=self.worker)
        return usage


@dataclass
class TokenItem(Record):
    """One request's new tokens in one engine step.

    ``start`` is the output index of ``ids[0]``. ``context`` is the token ids just before
    ``ids`` (the last prompt tokens, then earlier output), of which the first
    ``prompt_context`` are prompt tokens: with them a detokenizer replica that has never seen
    this request turns ``ids`` into exactly the text they add (see
    stages/detokenizer/incremental.py). ``reply_version`` is the wire version the job's
    requester reads (its job's; jobs/requests.py): its deltas' ``finish`` is written in it.
    ``bundle`` is its job's ``bundle_replies``: its delta may share an entry with others.
    ``text_only`` is its job's (jobs/requests.py): its bundled delta carries the number of
    its ids, not the ids.
    ``embedding`` is an embedding job's answer (jobs/requests.py's ``pooling``), on its one
    item: the L2-normalized pooled hidden state as packed little-endian float32 (`pack_floats`).
    ``tag`` is its job's (jobs/requests.py), for a bundled job only: such an item is named by
    it, and carries its ``rid`` too only at ``start`` 0 (its request's first delta names both);
    read back without one, ``rid`` is None.
    """

    FIELDS: ClassVar[dict[str, str]] = {
        "rid": STR, "reply_to": STR, "start": INT, "ids": IDS, "context": IDS,
        "prompt_context": INT, "stop": LIST, "skip_special_tokens": BOOL, "finish": RECORD,
        "logprobs": LIST, "top_logprobs": LIST, "prompt_ids": IDS, "prompt_logprobs": LIST,
        "prompt_top_logprobs": LIST, "reply_version": INT, "bundle": BOOL, "embedding": BYTES,
        "tag": INT, "text_only": BOOL,
    }  # fmt: skip
    OPTIONAL: ClassVar[frozenset[str]] = frozenset(FIELDS) - {
        "rid", "reply_to", "start", "ids", "context"
    }  # fmt: skip

    rid: str | None  # None: named by its tag alone (a bundled job's items after its first)
    reply_to: str
    start: int
    ids: list[int]
    context: list[int]
    prompt_context: int = 0
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
    reply_version: int = WIRE_VERSION
    bundle: bool = False
    embedding: bytes | None = None
    tag: int | None = None
    text_only: bool = False

    def to_wire(self, shared_reply: tuple[str, bool, bool] | None = None) -> dict[str, Any]:
        """`shared_reply`: the (reply_to, bundle, text_only) its batch writes once for the
        items that share it (`TokenBatch`); an item that does leaves them off."""
        # Written field by field, not through Record's loop: a worker writes one item per
        # request per step, the bus's hottest record. Optional fields that hold their
        # default stay off the wire (most items stop on nothing and skip specials).
        wire: dict[str, Any] = {
            "start": self.start, "ids": pack_ids_narrow(self.ids),
            "context": pack_ids_narrow(self.context),
        }  # fmt: skip
        if self.tag is None or self.start == 0 or not self.bundle:  # read by its tag: bundled
            wire["rid"] = self.rid
        if self.tag is not None:
            wire["tag"] = self.tag
        shared = shared_reply == (self.reply_to, self.bundle, self.text_only)
        if not shared:
            wire["reply_to"] = self.reply_to
        if self.prompt_context:
            wire["prompt_context"] = self.prompt_context
        if self.stop:
            wire["stop"] = self.stop
        if not self.skip_special_tokens:
            wire["skip_special_tokens"] = False
        if self.finish is not None:
            wire["finish"] = self.finish.to_wire()
        if self.prompt_ids is not None:
            wire["prompt_ids"] = pack_ids_narrow(self.prompt_ids)
        for name in ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"):
            value = getattr(self, name)
            if value is not None:
                wire[name] = value
        if self.reply_version != WIRE_VERSION:
            wire["reply_version"] = self.reply_version
        if self.bundle and not shared:
            wire["bundle"] = True
        if self.text_only and not shared:
            wire["text_only"] = True
        if self.embedding is not None:
            wire["embedding"] = self.embedding
        return wire

    @classmethod
    def from_wire(cls, data: Any, shared_reply: dict[str, Any] | None = None) -> TokenItem:
        """`shared_reply`: its batch's ``reply_to``, ``bundle`` and ``text_only``, for an
        item without its own."""
        if isinstance(data, list):
            item = cls(**token_item_fields_from_list(data))
        elif isinstance(data, dict):
            defaults = shared_reply if "reply_to" not in data else None
            if "rid" not in data:  # named by its tag alone, or a malformed item: `check` says
                defaults = {**(defaults or {}), "rid": None}
            item = super().from_wire(data, defaults)
        else:
            raise ProtocolError("a token item must be a map")
        if item.finish is not None:
            item.finish = Finish.from_wire(item.finish)
        item.check()
        return item

    def check(self) -> None:
        """What the field kinds alone do not say."""
        if self.rid is None:
            if self.tag is None:
                raise ProtocolError("field 'rid' is missing")
            if not self.bundle:
                raise ProtocolError("an item named by its tag alone must be bundled: a plain "
                                    "delta names its rid")  # fmt: skip
        check_tag(self.tag)
        if not all(isinstance(s, str) for s in self.stop):
            raise ProtocolError("field 'stop' must be a list of strings")
        if not 0 <= self.prompt_context <= len(self.context):
            raise ProtocolError("field 'prompt_context' exceeds the context")
        if not 1 <= self.reply_version <= WIRE_VERSION:
            raise ProtocolError(f"field 'reply_version' must be 1 to {WIRE_VERSION}")
        check_floats("embedding", self.embedding)


def pack_floats(values: Any) -> bytes:
    """A vector as packed little-endian float32 (an embedding on the wire, and OpenAI's
    base64 encoding of one). numpy is imported here, by the worker and the ingress that
    pack vectors: every stage loads this module, and its import was ~0.15 s of a start."""
    import numpy as np

    return np.asarray(values, dtype="<f4").tobytes()


def check_floats(name: str, packed: bytes | None) -> None:
    if packed is not None and len(packed) % 4:
        raise ProtocolError(f"field {name!r}: {len(packed)} bytes is not a multiple of 4")


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
