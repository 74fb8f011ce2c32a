"""A client that leaves mid-answer (a user pressing stop) is no server error: nothing is
logged as a failure and nothing counted a 500. The ingress on the real Redis, the worker
scripted; the error middleware on a real aiohttp server.

A stream's handler can meet its client's leaving at the body's end without having been
cancelled: a send the client reset closes the connection before aiohttp tells the handler,
and aiohttp's cancellation of the handler can be lost in Python 3.11's `asyncio.wait_for`,
which redis-py wraps each send in (runtime/task_cancel.py). Both ended in a logged 500, for
~20% of the Responses streams and a few chat streams cut short under load.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import aiohttp
import pytest
from aiohttp import web

from jobs.protocol import GenerateRequest
from stages.ingress.errors import client_gone, error_middleware
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas
from tests.prometheus_text import total

STREAMS = 120


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url) as server:
        add_worker(redis_client, server.config)
        yield server


def _answered(request: GenerateRequest):
    return deltas(request.rid, [(f" w{i}", [i]) for i in range(1, 6)], reason="length")


async def _cut_streams(url: str, path: str, body: dict) -> int:
    """STREAMS streams, 16 at a time, each read to a random event and dropped there."""
    cut = 0
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            nonlocal cut
            keep = random.randint(1, 12)
            async with session.post(url + path, json=body) as response:
                assert response.status == 200
                seen = 0
                async for line in response.content:
                    seen += line.startswith(b"data:")
                    if seen >= keep:
                        cut += 1
                        response.close()  # the connection dropped, not given back
                        return

        for start in range(0, STREAMS, 16):
            await asyncio.gather(*(one() for _ in range(min(16, STREAMS - start))))
    return cut


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/responses", {"model": MODEL, "input": "Hi", "stream": True}),
        ("/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}),
    ],
)  # fmt: skip
def test_streams_cut_at_any_point_are_no_failures(ingress, caplog, path, body):
    random.seed(path)
    with caplog.at_level(logging.ERROR), Upstream(ingress.config.redis_url, ingress.config,
                                                  _answered):  # fmt: skip
        cut = asyncio.run(_cut_streams(ingress.url, path, body))
        assert cut > STREAMS // 2
        # Every stream counted (its handler's end, after its client left) before looking.
        deadline = time.monotonic() + 10
        while True:
            text = ingress.request("GET", "/metrics")[2].decode()
            if (total(text, "streamserve:requests_total", endpoint=path) or 0) >= STREAMS:
                break
            assert time.monotonic() < deadline, "the cut streams were never counted"
            time.sleep(0.05)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]
    assert not total(text, "streamserve:requests_total", endpoint=path, status="500")


def test_what_a_handler_raises_after_its_client_left_is_no_failure(caplog):
    outcomes: list[str] = []

    @web.middleware
    async def outcome(request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            outcomes.append("cancelled")  # as aiohttp ends a handler whose client left
            raise
        outcomes.append(str(response.status))
        return response

    async def streams_until_its_client_leaves(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        while not client_gone(request):
            await asyncio.sleep(0.01)
        raise RuntimeError("met after the client left")

    async def main() -> None:
        app = web.Application(middlewares=[outcome, error_middleware])
        app.router.add_get("/", streams_until_its_client_leaves)
        runner = web.AppRunner(app)  # no handler cancellation: the handler runs on
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            writer.close()
            for _ in range(200):
                if outcomes:
                    break
                await asyncio.sleep(0.01)
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert outcomes == ["cancelled"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
