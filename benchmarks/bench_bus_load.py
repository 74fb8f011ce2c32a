"""What the bus and the CPU stages cost per token under load, with synthetic workers (no
model: gpu_worker/synthetic_engine.py), so every CPU cycle measured is the bus's.

    python benchmarks/bench_bus_load.py --workers 2 --step-ms 10 --batch 64 \
        --ingress 1 --detokenizers 1 --clients 16 --max-tokens 64 --seconds 10 \
        [--shards 3] [--out f.jsonl]

Starts `streamserve up` on its own embedded Redis server (with ``--shards S``: a Redis
Cluster of S primaries of the embedded binary, one pipeline on each) with N synthetic
workers, M ingress and M detokenizer replicas, one tokenizer and one router (each per
shard); K clients in this process run streaming /v1/chat/completions requests back to back
(the ingress replicas share a port, and the kernel spreads the clients' connections over
them). After ``--warm-up`` seconds, ``CONFIG RESETSTAT``; ``--seconds`` later, the figures
of that window:

- tok_s: tokens delivered to the clients, counted from their SSE streams
- Redis: commands (and by name), bytes in and out, CPU-µs (``INFO cpu``), per token, summed
  over the shards; the busiest shard's cores
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
import tempfile
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
from runtime.cluster import shard_configs  # noqa: E402
from runtime.config import BusConfig  # noqa: E402
from tests.cluster_fixture import running_cluster  # noqa: E402

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


class Servers:
    """The Redis server, or every primary of a Redis Cluster (one per shard), as one: their
    counts summed."""

    def __init__(self, redis_url: str) -> None:
        self.shards = shard_configs(BusConfig(redis_url=redis_url))
        self.clients = [redis.Redis.from_url(shard.redis_url) for shard in self.shards]

    def live_workers(self) -> int:
        return sum(len(read_liveness(client, shard).beats)
                   for client, shard in zip(self.clients, self.shards, strict=True))  # fmt: skip

    def reset_stats(self) -> None:
        for client in self.clients:
            client.config_resetstat()

    def cpu(self) -> list[float]:
        """Each server's CPU seconds (user + system)."""
        infos = [client.info("cpu") for client in self.clients]
        return [info["used_cpu_sys"] + info["used_cpu_user"] for info in infos]

    def commands(self) -> dict[str, int]:
        calls: dict[str, int] = {}
        for client in self.clients:
            for name, stats in client.info("commandstats").items():
                name = name.removeprefix("cmdstat_")
                calls[name] = calls.get(name, 0) + stats["calls"]
        return calls

    def stats(self) -> dict[str, int]:
        keys = ("total_net_input_bytes", "total_net_output_bytes")
        infos = [client.info("stats") for client in self.clients]
        return {key: sum(info[key] for info in infos) for key in keys}


def wait_for_workers(servers: Servers, count: int) -> None:
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while servers.live_workers() < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} workers did not beat within {WORKERS_TIMEOUT_S} s")
        time.sleep(0.25)


def snapshot(servers: Servers, launcher: int, counts: Counts) -> dict:
    return {
        "at": time.perf_counter(),
        "tokens": counts.tokens,
        "requests": counts.requests,
        "redis_cpu": servers.cpu(),
        "cpu": {**tree_cpu_by_kind(launcher), "clients": self_cpu()},
    }


async def drive(args: argparse.Namespace, url: str, servers: Servers) -> dict:
    import aiohttp

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
        servers.reset_stats()
        before = snapshot(servers, launcher, counts)
        await asyncio.sleep(args.seconds)
        after = snapshot(servers, launcher, counts)
        commands = servers.commands()
        stats = servers.stats()
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
    redis_cpu = [b - a for a, b in zip(before["redis_cpu"], after["redis_cpu"], strict=True)]
    redis_us = 1e6 * sum(redis_cpu) / tokens
    worker_tok_s = args.worker_tok_s or args.batch * 1000 / args.step_ms
    stage_us = {kind: us for kind, us in per_token.items() if kind not in ("clients", "launcher")}
    return {
        "benchmark": "bus-load",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "shards": args.shards,
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
        "client_last_error": counts.last_error,
        "redis_commands_per_token": round(sum(commands.values()) / tokens, 3),
        "redis_bytes_in_per_token": round(stats["total_net_input_bytes"] / tokens, 1),
        "redis_bytes_out_per_token": round(stats["total_net_output_bytes"] / tokens, 1),
        "redis_cpu_us_per_token": round(redis_us, 2),
        "redis_cores": round(sum(redis_cpu) / wall, 3),
        # A shard runs its commands on one core: the busiest is the one that bounds.
        "redis_cores_busiest_shard": round(max(redis_cpu) / wall, 3),
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
    parser.add_argument("--shards", type=int, default=1,
                        help="primaries of a Redis Cluster of the embedded binary, each a "
                        "pipeline of its own (1: one plain server)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2, help="per shard")
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
    with contextlib.ExitStack() as stack:
        node = None
        if args.shards > 1:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="bus-load-"))
            node = stack.enter_context(running_cluster(Path(folder), args.shards))[0]
        url, redis_url = stack.enter_context(started_pipeline(
            args, log_level="WARNING", up_args=up_args, redis_url=node))  # fmt: skip
        servers = Servers(redis_url)
        wait_for_workers(servers, args.workers * len(servers.shards))
        row = asyncio.run(drive(args, url, servers))
    emit({**row, **jsonl.machine(), "model": args.model}, args.out)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
