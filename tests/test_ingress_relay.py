"""Deltas relayed to a stream as the reply reader routes them (Submission.relay): a stream
whose deltas come one at a time, each while its handler waits, is byte for byte the stream
of the same deltas come all at once, and the relay did write it; bundled as a detokenizer
bundles them (tags, token counts), most are taken from their fields (the reader's sinks)."""

from __future__ import annotations

import gc
import json
import re
import socket
import time
import urllib.parse
import weakref

import pytest

from jobs.protocol import ENTRY_FIELD, TextDelta, TextDeltas, encode
from stages.ingress.api import sse
from stages.ingress.api.sse import SSEStream
from stages.ingress.streaming.submission import Submission
from tests.ingress_harness import (
    MODEL,
    RunningIngress,
    Upstream,
    _requests_in,
    add_worker,
    deltas,
)

PIECES = [("Once", [1]), (" up", [2, 3]), ('on \u00e9"\n', [4]), ("", [5]), (" a", [6, 7])]
PATHS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"prompt": "Hi"},
}


class Trickle(Upstream):
    """Writes each job's deltas one at a time, `gap_s` apart (0: all in one go); `bundled`:
    each in a TextDeltas, as a detokenizer writes a job that asked for bundles."""

    def __init__(self, redis_url, config, gap_s: float, bundled: bool = False) -> None:
        super().__init__(redis_url, config, lambda request: deltas(request.rid, PIECES))
        self.gap_s = gap_s
        self.bundled = bundled

    def _entry(self, request, message: TextDelta) -> bytes:
        if not self.bundled:
            return encode(message)
        message.tag = request.tag
        if request.text_only:
            message.n, message.ids = len(message.ids), []
        return encode(TextDeltas([message]))

    def _run(self) -> None:
        last = "0-0"
        while not self._stop.is_set():
            response = self.client.xread({self.config.requests_stream(): last}, block=50)
            for entry_id, fields in response[0][1] if response else []:
                last = entry_id
                for request in _requests_in(fields):
                    self.requests.append(request)
                    for message in self.script(request):
                        time.sleep(self.gap_s)
                        entry = self._entry(request, message)
                        self.client.xadd(request.reply_to, {ENTRY_FIELD: entry})


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url) as server:
        add_worker(redis_client, server.config)
        yield server


def _stream(ingress, path: str, gap_s: float, bundled: bool = False) -> bytes:
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            **PATHS[path]}  # fmt: skip
    with Trickle(ingress.config.redis_url, ingress.config, gap_s, bundled):
        status, _, data = ingress.request("POST", path, body)
    assert status == 200
    return _without_ids(data)


def _without_ids(events: bytes) -> bytes:
    """`events` with each request's own id and creation time taken out of its chunks."""
    return re.sub(rb'"id":"[^"]*","object":"([^"]*)","created":\d+', rb"\1", events)


@pytest.mark.parametrize("bundled", [False, True])
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_trickled_stream_is_relayed_and_the_same_bytes(
    ingress, monkeypatch, path, blocked, bundled
):
    """`blocked`: the relay may not write (as for a client behind): the handler writes."""
    if blocked:
        monkeypatch.setattr(sse, "WRITE_NOW_BUFFER", -1)
    relayed, by_fields = [], []
    write_now, relayed_text = SSEStream.write_now, Submission._relayed_text

    def counted(self, nudge):
        relayed.append(bool(self._pending))
        write_now(self, nudge)

    def counted_text(self, rid, text, count):
        taken = relayed_text(self, rid, text, count)
        by_fields.append(taken)
        return taken

    monkeypatch.setattr(SSEStream, "write_now", counted)
    monkeypatch.setattr(Submission, "_relayed_text", counted_text)
    at_once = _stream(ingress, path, 0.0)
    trickled = _stream(ingress, path, 0.05, bundled)
    assert trickled == at_once
    assert trickled.count(b"\n\ndata: ") >= len(PIECES)  # one event a piece with text, usage
    assert sum(relayed) >= 2  # the relay took deltas that came while the handler waited
    # Bundled, deltas between the first (it names the rid) and the last (its finish) were
    # taken from their fields (those that came while the handler waited: most, not all, on
    # a loaded machine); never one that was not bundled.
    assert (sum(by_fields) >= 2) if bundled else not by_fields
    assert len(by_fields) <= len(PIECES) - 2


def test_a_finished_stream_leaves_no_garbage_for_the_collector(ingress, monkeypatch):
    """A request's Submission is freed when its handler ends, by reference counting alone:
    a reference cycle per request (it and its reply queue) was ~10 objects a request for
    the collector's walks of the older generations to find."""
    made = []
    init = Submission.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Submission, "__init__", tracked)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # only reference counting frees it now
    try:
        _stream(ingress, "/v1/chat/completions", 0.02, bundled=True)
        deadline = time.monotonic() + 5
        while any(ref() is not None for ref in made) and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler ends just after its client has the last event
        assert made and all(ref() is None for ref in made)
    finally:
        if was_enabled:
            gc.enable()


def _raw_stream(ingress, version: str, gap_s: float) -> tuple[bytes, bytes]:
    """(headers, body) of a trickled chat stream as the socket carried them, over `version`."""
    body = json.dumps({"model": MODEL, "stream": True, **PATHS["/v1/chat/completions"]})
    host, port = urllib.parse.urlsplit(ingress.url).netloc.split(":")
    with Trickle(ingress.config.redis_url, ingress.config, gap_s):
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(
                f"POST /v1/chat/completions {version}\r\nHost: x\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                f"{body}".encode()
            )
            received = b""
            while chunk := connection.recv(65536):
                received += chunk
    headers, _, payload = received.partition(b"\r\n\r\n")
    return headers, payload


def _unchunked(payload: bytes) -> bytes:
    """A chunked body's data, checking every chunk's framing on the way."""
    data = b""
    while True:
        size_line, _, payload = payload.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert payload == b"\r\n"
            return data
        assert payload[size : size + 2] == b"\r\n"
        data, payload = data + payload[:size], payload[size + 2 :]


def test_relayed_events_are_framed_as_chunks_over_http11_and_plain_over_http10(ingress):
    headers, payload = _raw_stream(ingress, "HTTP/1.1", 0.05)
    assert b"transfer-encoding: chunked" in headers.lower()
    events = _unchunked(payload)
    assert events.endswith(b"data: [DONE]\n\n")
    assert events.count(b"data: ") >= len(PIECES)
    headers, payload = _raw_stream(ingress, "HTTP/1.0", 0.05)
    assert b"transfer-encoding" not in headers.lower()
    assert payload.startswith(b"data: ") and payload.endswith(b"data: [DONE]\n\n")
    assert _without_ids(payload) == _without_ids(events)
