"""What the bus costs per generated token, counted by the Redis server itself: a workload
through `streamserve up` and its OpenAI API, with the server's ``INFO commandstats`` and
``INFO stats`` read between ``CONFIG RESETSTAT`` (after a warm-up) and the workload's end.

    python benchmarks/bench_bus_cost.py [--workload mixed-64] [--dtype auto] [--out f.jsonl]

Prints one JSON line: commands and bytes into Redis per generated token, and the commands
by name (per token) that make up the total. BENCHMARKS.md's ``bus-burst``. Redis's own
housekeeping (the stages' trims, heartbeats, metrics publishing, idle reads) is counted
too: it is part of what a deployment costs its server. It costs per second, not per token,
so the same system idle for ``--idle-s`` after the workload gives its rate, and
``flow_commands_per_token`` and ``flow_bytes_in_per_token`` are what the tokens cost beyond
it (on a slow host the per-second
part dominates the total). With ``--workload single`` (batch 1, no drafts) a token is a step.

With ``--synthetic-step-ms MS`` the worker is a synthetic one (gpu_worker/synthetic_engine.py:
no model, one token per running request every MS, up to 64 at once): the same workload at an
accelerator's pace, where a publish carries several steps (on these CPUs each step of the
model is its own publish).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline import WARM_UP, bus_workload_parser, client_options, started_pipeline  # noqa: E402

from benchmarks import jsonl  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from cli import bench  # noqa: E402
from cli.workloads import make_workload  # noqa: E402


def measure(args: argparse.Namespace) -> dict:
    up_args = []
    if args.synthetic_step_ms is not None:
        up_args = ["--worker-arg=--synthetic", f"--worker-arg=--synthetic-step-ms="
                   f"{args.synthetic_step_ms}", "--worker-arg=--synthetic-batch=64"]  # fmt: skip
        args.dtype = None  # no weights to load
    with started_pipeline(args, log_level="WARNING", up_args=up_args) as (url, redis_url):
        options = client_options(url, args)
        asyncio.run(bench.run_source(options, WARM_UP))
        server = redis.Redis.from_url(redis_url)
        server.config_resetstat()
        started = time.monotonic()
        (row,) = asyncio.run(bench.run_source(options, make_workload(args.workload)))
        seconds = time.monotonic() - started
        commands = _commands(server)
        bytes_in = server.info("stats")["total_net_input_bytes"]
        server.config_resetstat()
        time.sleep(args.idle_s)
        idle_per_s = sum(_commands(server).values()) / args.idle_s
        idle_bytes_per_s = server.info("stats")["total_net_input_bytes"] / args.idle_s
    tokens = row["output_tokens"]
    flow = sum(commands.values()) - idle_per_s * seconds
    flow_bytes = bytes_in - idle_bytes_per_s * seconds
    by_command = {name: round(calls / tokens, 4) for name, calls in
                  sorted(commands.items(), key=lambda item: -item[1])}  # fmt: skip
    return {
        "workload": args.workload,
        "api": args.api,
        "system": "pipeline-http",
        "synthetic_step_ms": args.synthetic_step_ms,
        "output_tok_s": row["output_tok_s"],
        "output_tokens": tokens,
        "redis_commands": sum(commands.values()),
        "commands_per_token": round(sum(commands.values()) / tokens, 3),
        "bytes_in_per_token": round(bytes_in / tokens, 1),
        "seconds": round(seconds, 2),
        "idle_commands_per_s": round(idle_per_s, 1),
        "flow_commands_per_token": round(max(flow, 0) / tokens, 4),
        "idle_bytes_in_per_s": round(idle_bytes_per_s),
        "flow_bytes_in_per_token": round(max(flow_bytes, 0) / tokens, 1),
        "commands_per_token_by_name": by_command,
    }


def _commands(server: redis.Redis) -> dict[str, int]:
    return {
        name.removeprefix("cmdstat_"): stats["calls"]
        for name, stats in server.info("commandstats").items()
    }


def main() -> None:
    parser = bus_workload_parser(__doc__)
    parser.add_argument(
        "--idle-s",
        type=float,
        default=10.0,
        help="seconds idle after the workload, for the per-second rate",
    )
    parser.add_argument(
        "--synthetic-step-ms",
        type=float,
        help="a synthetic worker of this step time in place of the model",
    )
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    emit({**measure(args), **jsonl.machine(), "model": args.model, "dtype": args.dtype},
         args.out)  # fmt: skip


if __name__ == "__main__":
    main()
