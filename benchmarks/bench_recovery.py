"""Recovery time per stage kind: under a steady streaming load, kill -9 one replica of each
kind in turn and measure how long the requests in flight stall.

    python benchmarks/bench_recovery.py [--clients 16] [--settle 8]

`streamserve up` runs two replicas of every stage and two workers, with the defaults users
get (claim idle 5 s, heartbeat TTL 5 s). Clients loop over streaming completions and, when
their stream breaks, resume it with Last-Event-ID (benchmarks/resumable_stream.py). For each
kill: `stall_max_s` is the longest time from the kill to the next token of a request that
was in flight then (sent, not finished): the time until the replacement (a peer's claim,
the reaper and a live worker, a resumed stream) served it; `stall_p50_s` is the median over
those requests. One JSON line per kind, then one with the whole run's request and error
counts (the target: no errors, every request complete).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from resumable_stream import StreamResult, stream_completion  # noqa: E402

from cli.bench import percentile  # noqa: E402
from tests.pipeline_harness import Pipeline  # noqa: E402

KINDS = [
    ("tokenizer", "stage tokenizer"),
    ("router", "stage router"),
    ("detokenizer", "stage detokenizer"),
    ("worker", "gpu_worker"),
    ("ingress", "stage ingress"),
]


def stalls(results: list[StreamResult], killed_at: float) -> list[float]:
    in_flight = [
        r for r in results if r.sent_at < killed_at and (r.done_at is None or r.done_at > killed_at)
    ]
    out = []
    for r in in_flight:
        after = r.next_chunk_after(killed_at)
        if after is not None:
            out.append(after - killed_at)
    return out


async def run(system: Pipeline, args: argparse.Namespace) -> list[dict]:
    results: list[StreamResult] = []
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def client(index: int) -> None:
            n = 0
            while not stop.is_set():
                body = {
                    "model": system.model, "prompt": f"Client {index}, story {n}:",
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                }  # fmt: skip
                result = StreamResult(time.monotonic())
                results.append(result)
                await stream_completion(session, system.url, body, result)
                n += 1

        clients = [asyncio.create_task(client(i)) for i in range(args.clients)]
        rows = []
        await asyncio.sleep(args.settle)
        for kind, needle in KINDS:
            pid = system.replica_pids(needle)[0]
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(args.settle + 10)  # past every recovery deadline
            waits = stalls(results, killed_at)
            failed = sum(1 for r in results if r.error and r.sent_at >= killed_at)
            rows.append({
                "benchmark": "recovery", "killed": kind, "in_flight": len(waits),
                "errors_since_kill": failed,
                "stall_max_s": round(max(waits), 2) if waits else None,
                "stall_p50_s": round(percentile(waits, 0.5), 2) if waits else None,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        stop.set()
        await asyncio.gather(*clients)
    errors = [r.error for r in results if r.error]
    incomplete = [r for r in results if r.error is None and r.completion_tokens != args.max_tokens]
    rows.append({
        "benchmark": "recovery", "requests": len(results), "errors": len(errors),
        "error_samples": errors[:3], "incomplete": len(incomplete),
        "resumed_streams": sum(1 for r in results if r.resumes),
    })  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--settle", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    replicas = {"ingress": 2, "tokenizers": 2, "routers": 2, "detokenizers": 2, "workers": 2}
    with Pipeline(args.model, env={}, **replicas) as system:
        rows = asyncio.run(run(system, args))
    if args.out:
        with args.out.open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
