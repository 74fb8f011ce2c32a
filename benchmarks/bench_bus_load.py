"""What the bus and the CPU stages cost per token under load, with synthetic workers (no
model: gpu_worker/synthetic_engine.py), so every CPU cycle measured is the bus's.

    python benchmarks/bench_bus_load.py --workers 2 --step-ms 10 --batch 64 \
        --ingress 1 --detokenizers 1 --clients 16 --max-tokens 64 --seconds 10 [--out f.jsonl]

Starts `streamserve up` on its own embedded Redis server with N synthetic workers, M ingress
and M detokenizer replicas, one tokenizer and one router; K clients in this process run
streaming /v1/chat/completions requests back to back (the ingress replicas share a port,
and the kernel spreads the clients' connections over them). After ``--warm-up`` seconds,
``CONFIG RESETSTAT``; ``--seconds`` later, the figures of that window:

- tok_s: tokens delivered to the clients, counted from their SSE streams
- Redis: commands (and by name), bytes in and out, CPU-µs (``INFO cpu``), per token
- cpu_us_per_token: each kind of process's CPU-µs (utime + stime from /proc) per token,
  summed over its replicas: ingress, tokenizer, router, detokenizer, worker, clients (this
  process), launcher
- capacity: tokens/s per core of each, and workers of ``--worker-tok-s`` per core
  (benchmarks/bus_capacity.py; docs/CAPACITY.md reads it)

One JSON line on stdout (and appended to --out). Targets (issue 27): each CPU stage at most
10 µs per token (>= 100k tokens/s per core). On a machine with fewer cores than processes,
everything shares them: CPU per token is still each process's own, but tok_s is bounded
by the machine, not the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline import started_pipeline  # noqa: E402

from benchmarks import jsonl  # noqa: E402
from benchmarks.bus_capacity import capacity  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from benchmarks.process_cpu import find_child, self_cpu, tree_cpu_by_kind  # noqa: E402
from bus.liveness import read_liveness  # noqa: E402
from cli.bench import sse_events  # noqa: E402
from runtime.config import BusConfig  # noqa: E402

WORKERS_TIMEOUT_S = 120.0
STOP_GRACE_S = 30.0


class Counts:
    """What the clients saw: tokens (each content chunk counts one until the usage chunk
    says how many there were), requests finished, and failures."""

    def __init__(self) -> None:
        self.tokens = 0
        self.requests = 0
        self.errors = 0
        self.last_error = ""


async def client_loop(session, url: str, body: dict, counts: Counts, stop: asyncio.Event) -> None:
    """One client: streaming requests back to back until `stop`."""
    while not stop.is_set():
        counted = 0
        try:
            async for chunk in sse_events(session, url + "/v1/chat/completions", body):
                usage = chunk.get("usage")
                if usage:
                    missing = usage["completion_tokens"] - counted
                    counts.tokens += missing
                    counted += missing
                elif chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    counts.tokens += 1
                    counted += 1
            counts.requests += 1
        except Exception as exc:  # counted and shown; the run goes on
            counts.errors += 1
            counts.last_error = repr(exc)[:300]
            await asyncio.sleep(0.1)


def wait_for_workers(redis_url: str, count: int) -> None:
    client, config = redis.Redis.from_url(redis_url), BusConfig(redis_url=redis_url)
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while len(read_liveness(client, config).beats) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} workers did not beat within {WORKERS_TIMEOUT_S} s")
        time.sleep(0.25)


def snapshot(server: redis.Redis, launcher: int, counts: Counts) -> dict:
    cpu = server.info("cpu")
    return {
        "at": time.perf_counter(),
        "tokens": counts.tokens,
        "requests": counts.requests,
        "redis_cpu": cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        "cpu": {**tree_cpu_by_kind(launcher), "clients": self_cpu()},
    }


async def drive(args: argparse.Namespace, url: str, redis_url: str) -> dict:
    import aiohttp

    server = redis.Redis.from_url(redis_url)
    launcher = find_child("cli up")
    assert launcher is not None, "streamserve up is not a child of this process"
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    counts, stop = Counts(), asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = [
            asyncio.create_task(client_loop(session, url, body, counts, stop))
            for _ in range(args.clients)
        ]
        await asyncio.sleep(args.warm_up)
        server.config_resetstat()
        before = snapshot(server, launcher, counts)
        await asyncio.sleep(args.seconds)
        after = snapshot(server, launcher, counts)
        commands = {
            name.removeprefix("cmdstat_"): stats["calls"]
            for name, stats in server.info("commandstats").items()
        }
        stats = server.info("stats")
        # Clients finish the request under way (one cut off would only be noise in the
        # ingress's log); any still running after that are cancelled.
        stop.set()
        await asyncio.wait(tasks, timeout=STOP_GRACE_S)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return figures(args, before, after, commands, stats, counts)


def figures(
    args: argparse.Namespace, before: dict, after: dict, commands: dict, stats: dict, counts: Counts
) -> dict:  # fmt: skip
    wall = after["at"] - before["at"]
    tokens = after["tokens"] - before["tokens"]
    if tokens <= 0:
        raise RuntimeError(f"no tokens reached the clients ({counts.errors} errors: "
                           f"{counts.last_error})")  # fmt: skip
    per_token = {
        kind: round(1e6 * (after["cpu"][kind] - before["cpu"].get(kind, 0.0)) / tokens, 2)
        for kind in sorted(after["cpu"])
    }
    cores = {
        kind: round((after["cpu"][kind] - before["cpu"].get(kind, 0.0)) / wall, 3)
        for kind in sorted(after["cpu"])
    }
    redis_us = 1e6 * (after["redis_cpu"] - before["redis_cpu"]) / tokens
    worker_tok_s = args.worker_tok_s or args.batch * 1000 / args.step_ms
    stage_us = {kind: us for kind, us in per_token.items() if kind not in ("clients", "launcher")}
    return {
        "benchmark": "bus-load",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "workers": args.workers,
        "step_ms": args.step_ms,
        "batch": args.batch,
        "worker_tok_s_nominal": round(args.batch * 1000 / args.step_ms),
        "ingress": args.ingress,
        "detokenizers": args.detokenizers,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "seconds": round(wall, 2),
        "tok_s": round(tokens / wall),
        "tokens": tokens,
        "requests": after["requests"] - before["requests"],
        "client_errors": counts.errors,
        "redis_commands_per_token": round(sum(commands.values()) / tokens, 3),
        "redis_bytes_in_per_token": round(stats["total_net_input_bytes"] / tokens, 1),
        "redis_bytes_out_per_token": round(stats["total_net_output_bytes"] / tokens, 1),
        "redis_cpu_us_per_token": round(redis_us, 2),
        "redis_cores": round((after["redis_cpu"] - before["redis_cpu"]) / wall, 3),
        "cpu_us_per_token": per_token,
        "cores": cores,
        "capacity": capacity({"redis": redis_us, **stage_us}, worker_tok_s),
        "commands_per_token_by_name": {
            name: round(calls / tokens, 4)
            for name, calls in sorted(commands.items(), key=lambda item: -item[1])
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="names the vocabulary only (no weights are loaded)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ingress", type=int, default=1)
    parser.add_argument("--detokenizers", type=int, default=1)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warm-up", type=float, default=5.0, help="seconds before counting")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds counted")
    parser.add_argument("--worker-tok-s", type=float, default=None,
                        help="the reference worker of the capacity figures "
                        "(default: batch x 1000 / step-ms)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    synthetic = ["--synthetic", f"--synthetic-step-ms={args.step_ms}",
                 f"--synthetic-batch={args.batch}"]  # fmt: skip
    up_args = [
        "--workers", str(args.workers), "--ingress", str(args.ingress),
        "--detokenizers", str(args.detokenizers), "--tokenizers", "1", "--routers", "1",
        *(f"--worker-arg={flag}" for flag in synthetic),
    ]  # fmt: skip
    with started_pipeline(args, log_level="WARNING", up_args=up_args) as (url, redis_url):
        wait_for_workers(redis_url, args.workers)
        row = asyncio.run(drive(args, url, redis_url))
    emit({**row, **jsonl.machine(), "model": args.model}, args.out)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
