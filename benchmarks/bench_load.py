"""Sustained load: N concurrent streaming clients for a fixed time against `streamserve up`.

    python benchmarks/bench_load.py [--clients 256] [--seconds 60] [--max-tokens 32]

Each client sends a streaming completion, reads it to the end, and sends the next, until
the time is up; requests in flight then finish. One JSON line: requests completed, errors
(the target is 0) with a sample of each kind, output tokens per second, TTFT and
inter-chunk latency percentiles. The system runs with the defaults users get.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from resumable_stream import StreamResult, stream_completion  # noqa: E402

from benchmarks.jsonl import emit  # noqa: E402
from cli.bench import percentile  # noqa: E402
from tests.pipeline_harness import Pipeline  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
    "What makes bread rise?",
    "Describe the sea at night.",
    "Give advice to a new gardener.",
    "Why is the sky blue?",
    "Summarize the plot of a heist film.",
]


async def run_load(url: str, model: str, clients: int, seconds: float, max_tokens: int):
    stop_at = time.monotonic() + seconds
    results: list[StreamResult] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(index: int) -> None:
            n = 0
            while time.monotonic() < stop_at:
                body = {"model": model, "prompt": PROMPTS[(index + n) % len(PROMPTS)],
                        "max_tokens": max_tokens, "temperature": 0.7, "seed": index * 1000 + n,
                        "ignore_eos": True}  # fmt: skip
                results.append(await stream_completion(session, url, body))
                n += 1

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.monotonic() - started
    return results, elapsed


def summarize(results: list[StreamResult], elapsed: float) -> dict:
    ok = [r for r in results if r.error is None]
    errors = collections.Counter(r.error.split(":")[0] for r in results if r.error)
    samples = {}
    for r in results:
        if r.error and r.error.split(":")[0] not in samples:
            samples[r.error.split(":")[0]] = r.error[:200]
    ttft = [r.chunk_times[0] - r.sent_at for r in ok if r.chunk_times]
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tokens = sum(r.completion_tokens or 0 for r in ok)

    def ms(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(1000 * value, 1)

    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "error_samples": samples,
        "seconds": round(elapsed, 1),
        "output_tok_s": round(tokens / elapsed, 1),
        "ttft_ms_p50": ms(ttft, 0.5),
        "ttft_ms_p99": ms(ttft, 0.99),
        "itl_ms_p50": ms(gaps, 0.5),
        "itl_ms_p99": ms(gaps, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--url", help="a running system (default: start streamserve up)")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    if args.url:
        results, elapsed = asyncio.run(
            run_load(args.url, args.model, args.clients, args.seconds, args.max_tokens)
        )
    else:
        with Pipeline(args.model, env={}) as system:
            results, elapsed = asyncio.run(
                run_load(system.url, args.model, args.clients, args.seconds, args.max_tokens)
            )
    row = {"benchmark": "load", "clients": args.clients, "max_tokens": args.max_tokens,
           "model": args.model, **summarize(results, elapsed)}  # fmt: skip
    emit(row, args.out)


if __name__ == "__main__":
    main()
