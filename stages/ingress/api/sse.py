"""Server-sent events for the streaming endpoints, in as few sends as the replies allow.

One send() per event was a third of the ingress's CPU under load (bench_bus_load with 128
clients: 2,346 sendto a second for 9,900 tokens a second, and py-spy found 35% of the
process in the socket transport's write). An `SSEStream` collects events and writes them
together whenever no further reply is waiting: the headers, the first chunk and the first
delta go out in one send, the last delta, the usage chunk, ``[DONE]`` and the chunked
terminator in another, and a stream whose replies piled up while the loop was busy catches
up in one. Nothing waits for a reply that has not come: the events are written before each
wait (`Submission.replies(before_wait=stream.flush)`), and the events of replies relayed
while the handler waits (`Submission.relay`) by `write_now`, once the replies read with
them are handled too.

`ChunkEncoder` encodes the fields every chunk of a stream repeats (id, object, created,
model, system fingerprint) once, so each chunk encodes only its choices; a chunk of one
choice's plain text (most of a stream's) encodes only that text (`ChunkEncoder.encode_text`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"
_MARK = "\x00text\x00"  # stands for a chunk's text in its cached encoding
# `write_now` writes only to a connection whose buffer holds at most this (a client keeping
# up): the write then never waits for the client, which a handler's awaited write does.
WRITE_NOW_BUFFER = 16 * 1024


# One encoder for every call: json.dumps with options builds a new one each time.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def encode_json(data: Any) -> bytes:
    return _ENCODER.encode(data).encode()


class _EventStreamResponse(web.StreamResponse):
    # aiohttp's Response holds its headers back to send them with the body; StreamResponse
    # sends them at prepare(). Held back here too, they go out with the first events. (If
    # aiohttp drops this attribute, headers are sent first, as before: one send more.)
    _send_headers_immediately = False


class SSEStream:
    """A streaming response's events, written in batches (see the module's docstring)."""

    def __init__(self, response: web.StreamResponse, transport: asyncio.Transport | None) -> None:
        self.response = response
        self._transport = transport
        self._pending: list[bytes] = []
        self._writer: Any = None  # once the headers are out: `_plain_chunks_writer`

    @classmethod
    async def start(
        cls, request: web.Request, extra_headers: dict[str, str] | None = None
    ) -> SSEStream:
        response = _EventStreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not hold events back
                **(extra_headers or {}),
            }
        )
        await response.prepare(request)
        return cls(response, request.transport)

    def add(self, data: Any, event_id: str | None = None) -> None:
        """An event of `data` as JSON, written at the next flush."""
        self.add_encoded(encode_json(data), event_id)

    def add_encoded(self, payload: bytes, event_id: str | None = None) -> None:
        if event_id is not None:
            self._pending.append(b"id: " + event_id.encode() + b"\n")
        self._pending.append(b"data: " + payload + b"\n\n")

    async def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            await self.response.write(data)

    def write_now(self, blocked: Callable[[], None]) -> None:
        """Write what is pending, outside the handler (`flush` is its awaited write); where
        that cannot be done without waiting (a connection closing, a client behind),
        `blocked` is called instead, for the handler to write it."""
        if not self._pending:
            return  # written by the handler already
        transport = self._transport
        if (transport is None or transport.is_closing()
                or transport.get_write_buffer_size() > WRITE_NOW_BUFFER):  # fmt: skip
            blocked()
            return
        data = b"".join(self._pending)
        if self._writer is not None:
            # A chunk of the chunked body framed and sent here, counted where aiohttp counts
            # its own (the access log's size): its awaited write (a coroutine, its checks and
            # framing) was ~2 us of the ~30 a relayed write costs the ingress.
            chunk = b"%x\r\n%b\r\n" % (len(data), data)
            transport.write(chunk)
            self._writer.output_size += len(chunk)
            self._pending.clear()
            return
        # The awaited write, run to its end here: with the buffer that low it does not wait
        # (aiohttp waits only for a transport paused past its high-water mark).
        write = self.response.write(data)
        try:
            write.send(None)
        except StopIteration:
            self._pending.clear()
            self._writer = self._plain_chunks_writer()
            return
        except Exception:  # not written: the handler's flush meets it again
            blocked()
            return
        self._pending.clear()  # written; waiting for the client to drain it is left to the
        write.close()  # handler's next awaited write

    def _plain_chunks_writer(self) -> Any:
        """aiohttp's writer of this body where the body goes out as uncompressed chunks (it
        decides at prepare(): an HTTP/1.0 client gets none), for `write_now` to send the
        next chunks itself; else None, and aiohttp writes them."""
        response = self.response
        writer = getattr(response, "_payload_writer", None)
        if (response.headers.get("Transfer-Encoding") != "chunked" or response.compression
                or not isinstance(getattr(writer, "output_size", None), int)):  # fmt: skip
            return None
        return writer

    async def close(self) -> None:
        """What is pending, ``[DONE]`` and the end of the body, in one send."""
        self._pending.append(DONE)
        data = b"".join(self._pending)
        self._pending.clear()
        await self.response.write_eof(data)


class ChunkEncoder:
    """A stream's chunks: `head` (the fields every chunk repeats) and `extra` (fields after
    the choices, e.g. ``usage: null``) encoded once, a prefix per system fingerprint."""

    def __init__(self, head: dict[str, Any], extra: dict[str, Any]) -> None:
        self._head = encode_json(head)[:-1]  # without its closing brace
        self._tail = (b"," + encode_json(extra)[1:-1] if extra else b"") + b"}"
        self._prefixes: dict[str | None, bytes] = {}
        self._text_parts: dict[tuple[str | None, int], tuple[bytes, bytes]] = {}

    def encode(self, fingerprint: str | None, choices: list[dict[str, Any]]) -> bytes:
        prefix = self._prefixes.get(fingerprint)
        if prefix is None:
            prefix = self._head + b',"system_fingerprint":' + encode_json(fingerprint)
            prefix = self._prefixes[fingerprint] = prefix + b',"choices":'
        return prefix + encode_json(choices) + self._tail

    def encode_text(
        self, fingerprint: str | None, index: int, text: str, shape: Callable[[str], Any]
    ) -> bytes:
        """``encode(fingerprint, [shape(text)])`` for `shape`, the choice `index`'s entry
        of a text, without encoding all of it per chunk: that entry is encoded once with a
        marker for its text, and split there (json.dumps puts a string in as
        `encode_basestring` writes it, so the bytes are the same)."""
        parts = self._text_parts.get((fingerprint, index))
        if parts is None:
            whole = self.encode(fingerprint, [shape(_MARK)])
            before, _, after = whole.rpartition(encode_json(_MARK))
            parts = self._text_parts[(fingerprint, index)] = (before, after)
        return parts[0] + encode_basestring(text).encode() + parts[1]
