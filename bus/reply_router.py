"""`ReplyRouter`: the sans-I/O core of a reply stream's readers (bus/replies.py).

It keeps an orderer per request the reader serves (bus/reply_order.py), says where and how
long the next XREAD reads and how far the stream may be trimmed, and turns each entry read
into the messages it releases, a TextDeltas bundle taken apart and each delta named by its
rid or its tag (bus/reply_tags.py). A malformed entry is logged and dropped: what a writer
puts on the stream cannot stop the reader.

A request may have a sink (`set_sink`): a delta of its that is text and a count alone
(`jobs.protocol.is_plain`), the next in its order, with nothing of its waiting in this
read's messages, goes to the sink from its map as it is read, no TextDelta built and
nothing released for it, unless the sink declines it. An ingress relays most of a stream
that way: building a TextDelta, ordering, queueing and handing it out took ~70 calls a
delta (builtins counted), the sink's path ~40, and the calls are what a delta costs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from bus.reply_order import Reply, ReplyOrderer
from bus.reply_tags import ReplyTags
from jobs.protocol import ENTRY_FIELD, ErrorReply, ProtocolError, TextDelta, TextDeltas, decode

logger = logging.getLogger(__name__)

READ_COUNT = 1024  # one XREAD drains a busy stream; entries are small
# XREAD returns as soon as a reply lands, so this bounds only how long a stop can take, and
# how often an idle reader asks Redis (once a second).
BLOCK_MS = 1000
TRIM_INTERVAL_S = 1.0
START_ID = "0-0"

# A request's sink: takes a plain delta's text and token count, True if it handled them.
Sink = Callable[[str | None, int], bool]


class ReplyRouter:
    """The sans-I/O core of both readers: what to read next, and whose each entry is.

    It keeps per-rid orderers for the requests a reader serves, says where and how long the
    next XREAD reads (`read_args`) and how far the stream may be trimmed (`trim_point`); the
    readers only make those calls and hand each rid its released messages.
    """

    def __init__(self, stream: str, *, block_ms: int = BLOCK_MS, count: int = READ_COUNT) -> None:
        self.stream = stream
        self.block_ms = block_ms
        self.count = count
        self.last_id: bytes | str = START_ID
        self._next_trim = 0.0
        self._orderers: dict[str, ReplyOrderer] = {}
        self._first_entry: dict[str, bytes] = {}  # of each request still running
        self.tags = ReplyTags()  # the requests' short names on this stream (bus/reply_tags.py)
        self._sinks: dict[str, Sink] = {}

    def register(self, rid: str) -> None:
        self._orderers[rid] = ReplyOrderer()
        self.tags.expect(rid)

    def tag(self, rid: str) -> int:
        """A tag for registered `rid`, to put in its job before submitting it."""
        return self.tags.give(rid)

    def set_sink(self, rid: str, sink: Sink | None) -> None:
        """Where registered `rid`'s plain deltas go as they are read (None: released)."""
        if sink is None:
            self._sinks.pop(rid, None)
        elif rid in self._orderers:
            self._sinks[rid] = sink

    def unregister(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self._orderers.pop(rid, None)
        self._first_entry.pop(rid, None)
        self.tags.forget(rid)

    def rids(self) -> list[str]:
        return list(self._orderers)

    def read_args(self, remaining: float | None = None) -> dict[str, Any]:
        """XREAD's arguments for the entries after the last one routed; it blocks for at most
        `block_ms`, or the `remaining` seconds a caller still waits if fewer."""
        block = self.block_ms
        if remaining is not None:
            block = max(1, min(block, int(remaining * 1000)))
        return {"streams": {self.stream: self.last_id}, "count": self.count, "block": block}

    def trim_point(self) -> bytes | str | None:
        """The id to trim the stream to, at most once per TRIM_INTERVAL_S.

        Entries already routed are dead weight, but those of a request still running are its
        history: if this reader dies, another replays them to resume the request's stream
        (stages/ingress/streaming/resume.py). So the stream is trimmed up to the first entry of the
        oldest running request, or to the last entry read when none runs.
        """
        now = time.monotonic()
        if now < self._next_trim or self.last_id == START_ID:
            return None
        self._next_trim = now + TRIM_INTERVAL_S
        if self._first_entry:
            return min(self._first_entry.values(), key=_id_order)
        return self.last_id

    def route(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[tuple[str, Reply]]:
        """(rid, message) for every message now released, in order; finished rids forgotten.
        Plain deltas their requests' sinks take are not among them (the module says when)."""
        out: list[tuple[str, Reply]] = []
        released: set[str] = set()  # rids with messages in `out`: theirs follow them there
        for entry_id, fields in entries:
            self.last_id = entry_id
            try:
                message = decode((fields or {}).get(ENTRY_FIELD), TextDelta, ErrorReply,
                                 TextDeltas, plain=bool(self._sinks))  # fmt: skip
            except ProtocolError as exc:
                logger.warning("%s: dropping malformed reply %s: %s", self.stream, entry_id, exc)
                continue
            if isinstance(message, TextDeltas):
                for delta in message.deltas:
                    if type(delta) is dict:  # a plain delta's map (decode's `plain`)
                        if self._sunk(entry_id, delta, released):
                            continue
                        delta = TextDelta.from_wire(delta)
                    for named_in, named in self.tags.name(entry_id, delta):
                        self._file(named_in, named, out, released)
            else:
                self._file(entry_id, message, out, released)
        return out

    def _sunk(self, entry_id: bytes, delta: dict[str, Any], released: set[str]) -> bool:
        rid = self.tags.rid_of.get(delta["tag"])
        sink = self._sinks.get(rid) if rid is not None else None
        if sink is None or rid in released:
            return False
        orderer = self._orderers[rid]
        if not orderer.is_next(delta["seq"]) or not sink(delta.get("text"), delta["n"]):
            return False
        orderer.next_seq += delta["n"]
        self._first_entry.setdefault(rid, entry_id)
        return True

    def _file(
        self, entry_id: bytes, message: Reply, out: list[tuple[str, Reply]], released: set[str]
    ) -> None:
        orderer = self._orderers.get(message.rid)
        if orderer is None:
            return  # a late reply to a request nobody waits for any more
        self._first_entry.setdefault(message.rid, entry_id)
        out.extend([(message.rid, ready) for ready in orderer.push(message)])
        released.add(message.rid)
        if orderer.done:
            self.unregister(message.rid)


def _id_order(entry_id: bytes) -> tuple[int, ...]:
    return tuple(int(part) for part in entry_id.split(b"-"))


def stream_entries(response: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The entries of a one-stream XREAD reply as redis-py's client parses it (RESP2 gives a
    list, RESP3 a dict)."""
    if not response:
        return []
    if isinstance(response, dict):
        return next(iter(response.values()))[0]
    return response[0][1]


def raw_stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The same from the reply as the connection reads it (no client's parsing): each
    entry's fields come as one flat list of names and values."""
    if not reply:
        return []
    entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
    return [
        (entry_id, dict(zip(flat[::2], flat[1::2], strict=False)) if flat else {})
        for entry_id, flat in entries
    ]
