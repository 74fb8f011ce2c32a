"""Slow clients are bounded at the ingress (stages/ingress/connections.py): a request head
or body trickled past its deadline loses its connection while other clients are served, and
connections past a replica's cap get a 503 before a byte of them is read."""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import socket
import time
import urllib.parse

import pytest

from runtime.config import BusConfig
from tests.ingress_harness import RunningIngress

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 3


def running(redis_url: str, **settings) -> RunningIngress:
    server = RunningIngress(redis_url)
    server.config = BusConfig(redis_url=redis_url, **settings)
    return server


@pytest.fixture(scope="module")
def deadlines(redis_url):
    with running(redis_url, ingress_header_timeout_s=HEADER_TIMEOUT_S,
                 ingress_body_timeout_s=BODY_TIMEOUT_S) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def capped(redis_url):
    with running(redis_url, ingress_max_connections=MAX_CONNECTIONS) as server:
        yield server


def open_socket(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closes `sock` (sending `trickle` a byte at a time meanwhile),
    None if still open after `seconds`."""
    began = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - began < seconds:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent : sent + 1])
                sent += 1
            if sock.recv(4096) == b"":
                return time.monotonic() - began
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - began
    return None


def test_a_head_trickled_past_the_deadline_is_cut_while_others_are_served(deadlines):
    slow = open_socket(deadlines)
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    cut_after = closed_within(slow, 10 * HEADER_TIMEOUT_S, trickle=head)
    slow.close()
    assert cut_after is not None, "a client trickling its headers kept its connection"
    assert HEADER_TIMEOUT_S * 0.8 <= cut_after <= HEADER_TIMEOUT_S + 2
    status, _, _ = deadlines.request("GET", "/v1/models")
    assert status == 200


def test_a_client_sending_nothing_is_cut_after_the_deadline(deadlines):
    opened = time.monotonic()
    idle = open_socket(deadlines)
    other = open_socket(deadlines)
    other.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert other.recv(4096).startswith(b"HTTP/1.1 200")
    other.close()
    assert closed_within(idle, 10 * HEADER_TIMEOUT_S) is not None
    assert time.monotonic() - opened >= HEADER_TIMEOUT_S * 0.8  # at its deadline, not at once
    idle.close()


@pytest.mark.parametrize(
    ("path", "content_type", "start"),
    [
        ("/v1/completions", "application/json", b"{"),
        ("/v1/files", "multipart/form-data; boundary=b",
         b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{'),
    ],
)  # fmt: skip
def test_a_body_trickled_past_the_deadline_gets_408_and_is_cut(deadlines, path, content_type,
                                                                start):  # fmt: skip
    slow = open_socket(deadlines)
    slow.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                 "Content-Length: 1000\r\n\r\n".encode() + start)  # fmt: skip
    slow.settimeout(BODY_TIMEOUT_S + 5)
    began = time.monotonic()
    answer = b""
    try:
        while chunk := slow.recv(65536):  # until the server closes the connection
            answer += chunk
            slow.sendall(b" ")  # trickling on does not keep it open
            time.sleep(0.05)
    except (ConnectionResetError, BrokenPipeError):
        pass  # closed while bytes were still coming: reset
    waited = time.monotonic() - began
    slow.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT_S * 0.8 <= waited <= BODY_TIMEOUT_S + 2


def _answer_past_the_cap(capped) -> bytes:
    """What one more connection is answered, once the server has taken every held one
    (it takes them in its own time: on a loaded machine a fixed wait was not enough)."""
    deadline = time.monotonic() + 5
    while True:
        extra = open_socket(capped)
        extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        extra.settimeout(5)
        answer = b""
        while chunk := extra.recv(65536):
            answer += chunk  # until the server closes it
        extra.close()
        if not answer.startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def test_connections_past_the_cap_get_503_and_are_closed(capped):
    held = [open_socket(capped) for _ in range(MAX_CONNECTIONS)]
    answer = _answer_past_the_cap(capped)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert b"retry-after: 1" in head.lower()
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    # A held connection is served as usual, and once one closes a new one is too.
    held[0].sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    held[0].settimeout(5)
    assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
    held.pop().close()
    deadline = time.monotonic() + 5
    while (status := capped.request("GET", "/v1/models")[0]) != 200:
        assert status == 503 and time.monotonic() < deadline  # until it has seen the close
        time.sleep(0.05)
    for sock in held:
        sock.close()


@pytest.mark.parametrize(
    "request_bytes",
    [b"GET /v1/models\xff HTTP/1.1\r\nHost: x\r\n\r\n",  # not a URL
     b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
)  # fmt: skip
def test_a_request_that_is_not_http_is_a_400_and_one_info_line(capped, caplog, request_bytes):
    """aiohttp logs such a request with its traceback at ERROR; a client must not be able
    to fill the log with them (connections.BadRequestLog)."""
    with open_socket(capped) as sock, caplog.at_level("INFO", logger="aiohttp.server"):
        sock.sendall(request_bytes)
        reply = sock.recv(4096)
        deadline = time.monotonic() + 5
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert reply.startswith(b"HTTP/1.1 400") or reply.startswith(b"HTTP/1.0 400"), reply
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [(r.levelname, r.exc_info) for r in records] == [("INFO", None)]
    assert "(400: " in records[0].getMessage()
    with caplog.at_level("WARNING", logger="aiohttp.server"):
        caplog.clear()
        with open_socket(capped) as sock:
            sock.sendall(request_bytes)
            sock.recv(4096)
        time.sleep(0.2)
    assert not [r for r in caplog.records if r.name == "aiohttp.server"]


def test_a_body_that_cannot_be_decoded_is_a_400_and_one_info_line(capped, caplog):
    """A body marked gzip that is not, or one that inflates past the body limit: the client's
    fault, answered as such (a 500 and an ERROR traceback before); a real gzip body is read."""
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with caplog.at_level("INFO"):
        status, body, closing = post_raw_bytes(capped.url + "/v1/chat/completions", b"garbage",
                                               headers)  # fmt: skip
        deadline = time.monotonic() + 5
        while not [r for r in caplog.records if r.name == "aiohttp.server"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    error = json.loads(body)["error"]
    assert status == 400 and error["code"] == "invalid_body", body
    assert closing == "close"  # aiohttp drops it: a client that pooled it would fail its next
    assert error["message"].endswith("cannot be read: Can not decode content-encoding: gzip")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    bomb = gzip.compress(b'{"model": "' + b"a" * (64 * 1024 * 1024) + b'"}')
    status, body, _ = post_raw_bytes(capped.url + "/v1/chat/completions", bomb, headers)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    unknown = gzip.compress(json.dumps({"model": "nope", "messages": []}).encode())
    status, body, _ = post_raw_bytes(capped.url + "/v1/chat/completions", unknown, headers)
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def post_raw_bytes(url: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
    """(status, body, the Connection header), on a keep-alive connection (urllib asks for
    its close on every request)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request("POST", parts.path, body=data, headers=headers)
        reply = connection.getresponse()
        return reply.status, reply.read(), reply.headers.get("Connection", "")
    finally:
        connection.close()
