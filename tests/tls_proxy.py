"""A TLS front for the embedded server, whose build has no TLS of its own.

It terminates TLS on a localhost port and relays the bytes to the server's unix socket, as
a cloud Redis's TLS endpoint or stunnel would; clients connect with `rediss://` and a CA
file, so the TLS handshake, the certificate check and the URL options are the real ones.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from pathlib import Path

import trustme


class TlsProxy:
    def __init__(self, unix_socket: Path, directory: Path) -> None:
        self.unix_socket = unix_socket
        authority = trustme.CA()
        self.ca_file = directory / "ca.pem"
        authority.cert_pem.write_to_path(str(self.ca_file))
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        authority.issue_cert("localhost").configure_cert(self.context)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.server: asyncio.base_events.Server | None = None

    def start(self) -> TlsProxy:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _serve(self) -> asyncio.base_events.Server:
        return await asyncio.start_server(self._relay, sock=self.listener, ssl=self.context)

    async def _relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter):
        server_in, server_out = await asyncio.open_unix_connection(str(self.unix_socket))
        await asyncio.gather(_pipe(client_in, server_out), _pipe(server_in, client_out))

    def __enter__(self) -> TlsProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        sink.close()
