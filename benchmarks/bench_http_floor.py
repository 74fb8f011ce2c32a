"""aiohttp's own floor under the ingress: what a bare aiohttp server costs to stream the
same answers, with no Redis, no model and none of the ingress's checks.

    python benchmarks/bench_http_floor.py [--writes 30] [--interval-ms 50] [--relay]
                                          [--clients 128] [--seconds 15] [--out F]

The server (on uvloop, as the ingress) reads each POST's JSON body, sends the SSE headers,
then `--writes` chunks shaped like an OpenAI chat chunk, one every `--interval-ms` (the
workers' publish interval: `bench_bus_load.py`'s 128-token requests get ~30 writes each),
then ``[DONE]``; with `--relay` one task writes every stream's chunks, as the ingress's
reply reader does, and a handler wakes only at its end. `--clients` keep-alive clients send
requests back to back. It prints the server's CPU (utime + stime) per request; a second run
at `--writes 1` says what a write costs beyond a request: the floor the ingress's CPU per
request and per token is read against (docs/CAPACITY.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp
import uvloop
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.process_cpu import process_cpu  # noqa: E402

CHUNK = (b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":'
         b'"chat.completion.chunk","created":1700000000,"model":"smollm2-135m-instruct",'
         b'"system_fingerprint":null,"choices":[{"index":0,"delta":{"content":" a few words"},'
         b'"logprobs":null,"finish_reason":null}]}\n\n')  # fmt: skip


def serve(port: int, writes: int, interval_s: float, relay: bool) -> None:
    streams: dict[web.StreamResponse, list] = {}  # relayed: response -> [writes left, done]

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})  # fmt: skip
        await response.prepare(request)
        if relay:
            done = asyncio.get_running_loop().create_future()
            streams[response] = [writes, done]
            await done
        else:
            for _ in range(writes):
                await asyncio.sleep(interval_s)
                await response.write(CHUNK)
        await response.write_eof(b"data: [DONE]\n\n")
        return response

    async def tick(app: web.Application) -> None:
        """One task writes every relayed stream's chunk, as the ingress's reply reader
        does (stages/ingress/api/sse.py's write_now), waking a handler only at its end."""
        while True:
            await asyncio.sleep(interval_s)
            for response, state in list(streams.items()):
                write = response.write(CHUNK)
                try:
                    write.send(None)
                except StopIteration:
                    pass
                else:
                    write.close()
                state[0] -= 1
                if state[0] <= 0:
                    del streams[response]
                    state[1].set_result(None)

    async def start_ticking(app: web.Application):
        task = asyncio.get_running_loop().create_task(tick(app))
        yield
        task.cancel()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    if relay:
        app.cleanup_ctx.append(start_ticking)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                loop=uvloop.new_event_loop())  # fmt: skip


async def drive(url: str, clients: int, seconds: float) -> int:
    """Requests answered in `seconds`, `clients` at a time."""
    stop_at = time.monotonic() + seconds
    done = 0
    body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 128,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}  # fmt: skip
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                async with session.post(url, json=body) as response:
                    async for _ in response.content:
                        pass
                done += 1

        await asyncio.gather(*(client() for _ in range(clients)))
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=30)
    parser.add_argument("--interval-ms", type=float, default=50.0)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--warm-up", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument(
        "--relay",
        action="store_true",
        help="one task writes every stream's chunks, as the ingress does",
    )
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    if not args.port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            args.port = probe.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        serve(args.port, args.writes, args.interval_ms / 1000, args.relay)
        os._exit(0)
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    try:
        time.sleep(1.5)  # the server's start
        asyncio.run(drive(url, args.clients, args.warm_up))
        before = process_cpu(pid)
        requests = asyncio.run(drive(url, args.clients, args.seconds))
        used = process_cpu(pid) - before
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    row = {"benchmark": "http-floor", "date": time.strftime("%Y-%m-%d %H:%M"),
           "writes": args.writes, "relay": args.relay, "interval_ms": args.interval_ms,
           "clients": args.clients,
           "seconds": args.seconds, "requests": requests, "server_cpu_s": round(used, 3),
           "server_us_per_request": round(used / max(requests, 1) * 1e6, 1)}  # fmt: skip
    line = json.dumps(row)
    print(line)
    if args.out:
        with args.out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
