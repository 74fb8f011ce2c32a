"""`streamserve bench`: the shared workloads against a running system, over HTTP or Redis.

    streamserve bench --url http://127.0.0.1:8000 --workloads mixed-64
    streamserve bench --redis-url unix:///tmp/redis.sock --workloads single,mixed-64

Every request of a workload is sent at once (token-id prompts, greedy, end-of-sequence
ignored, exactly the workload's output length), each streamed back; a progress bar counts
finished requests. One JSON line per workload goes to stdout: output tokens per second over
the wall time, TTFT and inter-token latency percentiles (a gap is the time between two
streamed chunks of a request, divided by the tokens the later chunk carries). A system
kept up serves a workload's prompts from its prefix cache the second time: compare runs on
freshly started systems (benchmarks/bench_pipeline.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from cli.workloads import WORKLOADS, Workload, make_workload

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass
class Timing:
    sent: float
    tokens: int = 0
    first: float | None = None
    gaps: list[float] = field(default_factory=list)
    last: float | None = None

    def chunk(self, now: float, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.extend([(now - self.last) / num_tokens] * num_tokens)
        self.last = now
        self.tokens += num_tokens


# A source streams (number of new tokens) per chunk for one token-id job.
Source = Callable[[list[int], dict[str, Any]], AsyncIterator[int]]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sampling_for(output_len: int) -> dict[str, Any]:
    return {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}


async def run_workload(source: Source, workload: Workload, progress: bool = True) -> dict:
    bar = tqdm(total=len(workload.prompts), desc=workload.name, disable=not progress,
               file=sys.stderr, unit="req")  # fmt: skip
    timings: list[Timing] = []

    async def one(prompt: list[int], output_len: int) -> None:
        timing = Timing(time.perf_counter())
        timings.append(timing)
        async for num_tokens in source(prompt, sampling_for(output_len)):
            timing.chunk(time.perf_counter(), num_tokens)
        bar.update()

    start = time.perf_counter()
    await asyncio.gather(
        *(one(p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    )
    wall = time.perf_counter() - start
    bar.close()
    produced = sum(t.tokens for t in timings)
    if produced != workload.output_tokens:
        raise RuntimeError(f"{workload.name}: got {produced} tokens, expected "
                           f"{workload.output_tokens}")  # fmt: skip
    ttfts = [t.first - t.sent for t in timings if t.first is not None]
    gaps = [g for t in timings for g in t.gaps]
    return {
        "workload": workload.name,
        "requests": len(workload.prompts),
        "output_tokens": produced,
        "wall_s": round(wall, 3),
        "output_tok_s": round(produced / wall, 1),
        "ttft_ms_p50": _ms(percentile(ttfts, 0.5)),
        "ttft_ms_p99": _ms(percentile(ttfts, 0.99)),
        "itl_ms_p50": _ms(percentile(gaps, 0.5)),
        "itl_ms_p99": _ms(percentile(gaps, 0.99)),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


async def sse_events(session: Any, url: str, body: dict[str, Any]) -> AsyncIterator[dict]:
    """POST `body` and yield each server-sent event's JSON payload, up to [DONE]."""
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{url} answered {reply.status}: {await reply.text()}")
        async for line in reply.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                yield json.loads(line[6:])


def http_source(session: Any, base_url: str) -> Source:
    """Native /generate with token ids, streamed as server-sent events."""

    async def stream(prompt: list[int], sampling: dict[str, Any]) -> AsyncIterator[int]:
        body = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
        async for event in sse_events(session, base_url + "/generate", body):
            yield len(event["output_ids"])

    return stream


def openai_source(session: Any, base_url: str, model: str) -> Source:
    """OpenAI's /v1/completions with a token-id prompt, streamed: what any OpenAI-compatible
    server (streamserve, vLLM) takes. A chunk carries text, not token ids, so
    each chunk counts as one token until the final usage chunk says how many there were;
    the difference is put on the last chunk."""

    async def stream(prompt: list[int], sampling: dict[str, Any]) -> AsyncIterator[int]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": sampling["max_new_tokens"],
            "temperature": sampling["temperature"],
            "ignore_eos": sampling["ignore_eos"],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        counted = 0
        async for chunk in sse_events(session, base_url + "/v1/completions", body):
            if chunk.get("usage"):
                missing = chunk["usage"]["completion_tokens"] - counted
                if missing:
                    yield missing
                counted += missing
            elif chunk.get("choices") and chunk["choices"][0].get("text"):
                counted += 1
                yield 1

    return stream


def redis_source(client: Any) -> Source:
    """Direct Redis jobs through bus.client.AsyncClient."""

    async def stream(prompt: list[int], sampling: dict[str, Any]) -> AsyncIterator[int]:
        rid = await client.submit(input_ids=prompt, sampling=sampling)
        async for chunk in client.stream(rid):
            yield len(chunk["output_ids"])

    return stream


async def run(args: argparse.Namespace) -> list[dict]:
    names = [name for name in args.workloads.split(",") if name]
    return await run_source(args, *(make_workload(name) for name in names))


async def run_source(
    args: argparse.Namespace, *workloads: Workload, echo: bool = True
) -> list[dict]:
    """Run `workloads` in turn over HTTP (args.url) or Redis (args.redis_url); return one
    figures dict each, also printed as a JSON line when `echo`."""
    results = []
    if args.redis_url:
        from bus.client import AsyncClient

        client = AsyncClient(args.redis_url)
        try:
            for workload in workloads:
                figures = await run_workload(redis_source(client), workload)
                results.append({**figures, "system": "pipeline-redis"})
                if echo:
                    print(json.dumps(results[-1]), flush=True)
        finally:
            await client.close()
        return results
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)  # every request of a workload at once
    # A server with API keys (stages/ingress/tenancy/auth.py) takes the first of ours.
    key = next(iter(os.environ.get("STREAMSERVE_API_KEY", "").split(",")), "").strip()
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers=headers
    ) as session:
        if args.api == "openai":
            source = openai_source(session, args.url, args.model or "default")
        else:
            source = http_source(session, args.url)
        for workload in workloads:
            figures = await run_workload(source, workload)
            results.append({**figures, "system": args.system or f"pipeline-{args.api}"})
            if echo:
                print(json.dumps(results[-1]), flush=True)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default=DEFAULT_URL, help=f"ingress (default {DEFAULT_URL})")
    parser.add_argument("--redis-url", default=None, help="send direct Redis jobs instead")
    parser.add_argument("--workloads", default="mixed-64", help=f"comma list of {WORKLOADS}")
    parser.add_argument(
        "--api",
        choices=("native", "openai"),
        default="native",
        help="native: streamserve's /generate; openai: /v1/completions, which any "
        "OpenAI-compatible server answers (give --model its model name)",
    )
    parser.add_argument("--system", default=None, help="name the system in the JSON lines")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds without a byte")
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)  # from the CLI
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in args.workloads.split(","):
        if name and name not in WORKLOADS:
            print(f"error: unknown workload {name!r}; known: {WORKLOADS}", file=sys.stderr)
            return 2
    asyncio.run(run(args))
    return 0
