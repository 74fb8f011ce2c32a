"""How an ingress replica bounds what its clients' connections hold: each connection's time
to send a request, and how many it serves at once (runtime/config.py's ``ingress_*`` settings).

- Headers: aiohttp closes a connection still waiting for a whole request head once its
  ``keepalive_timeout`` has passed since the connection opened or its last response ended
  (``RequestHandler._process_keepalive``), so that timeout, ``ingress_header_timeout_s``, is
  the deadline of a client trickling its headers as well as an idle keep-alive's life.
- Body: `body_deadline` gives every request's body ``ingress_body_timeout_s``, plus a
  second per ``MIN_BODY_BYTES_PER_S`` of its Content-Length (an upload of 200 MiB may take
  its time; a body trickled a byte at a time may not). Past it, whatever reads the body
  (a JSON body, a multipart upload) gets a 408, and the connection is closed.
- Connections: `CappedSite` hands a new connection to the app while fewer than
  ``ingress_max_connections`` are open, and answers any other with a 503 (Retry-After) and
  closes it, before reading a byte of it. The count is the app server's open connections
  when each is accepted, so a burst accepted in one turn of the event loop may pass the cap
  by at most that burst (the listen backlog).

A slow reader of its own responses (an SSE stream not read) is bounded elsewhere: its
handler blocks on the transport's write buffer, and its client going away cancels it.

A request aiohttp cannot parse (a request line, a header or a chunk that is not HTTP) gets
its 400 from aiohttp, which also logs it with a traceback at ERROR, as if the server had
failed: `BadRequestLog` makes that one INFO line, so a client cannot fill the log.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from stages.ingress.errors import ApiError, Handler

BODY_TIMEOUT_S = web.AppKey("streamserve_body_timeout_s", float)
MIN_BODY_BYTES_PER_S = 256 * 2**10  # the slowest a long body may come, on average
REFUSED_RETRY_AFTER_S = 1
REFUSED_LINGER_S = 1.0  # how long a refused client has to read its 503 before the close


class BodyTimeout(ApiError, TimeoutError):
    """A 408 to the handler reading the body; a TimeoutError to aiohttp, which then drops
    the rest of the body and closes the connection (rather than reading on)."""


@web.middleware
async def body_deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Fail the reads of a body not arrived by its deadline (measured from the head's)."""
    if not request.body_exists or request.content.is_eof():
        return await handler(request)  # nothing to wait for: all of it came with the head
    timeout_s = request.app[BODY_TIMEOUT_S] + (request.content_length or 0) / MIN_BODY_BYTES_PER_S
    content = request.content

    def expire() -> None:
        if not content.is_eof():  # is_eof: all of it has arrived, read or not
            message = f"the request body did not arrive within {timeout_s:.0f} s"
            content.set_exception(BodyTimeout(408, message, code="request_timeout",
                                              headers={"Connection": "close"}))  # fmt: skip

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        return await handler(request)
    finally:
        timer.cancel()


def _refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"this server has {max_connections} connections open, its most; retry later",
        "type": "service_unavailable", "param": None, "code": "too_many_connections",
    }}).encode()  # fmt: skip
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {REFUSED_RETRY_AFTER_S}\r\n"
            "Connection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


class _Refused(asyncio.Protocol):
    """A connection past the cap: its 503 is written at once, and the connection closed
    once the client has closed its side, or after REFUSED_LINGER_S (closing while its
    request still arrives could reset the connection before the client read the 503)."""

    def __init__(self, response: bytes) -> None:
        self.response = response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.response)
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request it will not serve

    def eof_received(self) -> bool:
        return False  # the client is done: close


class CappedSite(web.BaseSite):
    """A TCP site (SO_REUSEPORT, as replicas share the port) serving at most
    `max_connections` connections at once."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, max_connections: int,
                 **kwargs: object) -> None:  # fmt: skip
        super().__init__(runner, **kwargs)
        self._host, self._port = host, port
        self.max_connections = max_connections
        self._refusal = _refusal(max_connections)

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._connection, self._host, self._port, backlog=self._backlog, reuse_port=True
        )

    def _connection(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self.max_connections:
            return _Refused(self._refusal)
        return server()


class BadRequestLog(logging.Filter):
    """On aiohttp's server logger: its record of a request it could not parse, answered 400,
    as one INFO line naming the client and the fault, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, web.RequestPayloadError):  # a body it could not decode, met again
            exc = exc.__cause__  # as it drains what the handler's 400 left unread
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            fault = " ".join(str(exc.message).split())[:200]  # its message spans lines
            record.msg, record.args = "%s (%d: %s)", (record.getMessage(), exc.code, fault)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
            # Emitted past the ERROR call's level check: a handler takes it as INFO only
            # where the logger would have let an INFO record through.
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True

    @classmethod
    def install(cls) -> None:
        server_log = logging.getLogger("aiohttp.server")
        if not any(isinstance(f, cls) for f in server_log.filters):
            server_log.addFilter(cls())
