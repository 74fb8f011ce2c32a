"""What the bus costs: a workload through the whole pipeline and through the in-process
engine, in one run.

    python benchmarks/bench_pipeline.py [--workloads mixed-64] [--via http,redis] [--out f.jsonl]

`engine` is gpu_worker's Engine in this process. `pipeline-native` (`pipeline-http` in
earlier results) and `pipeline-redis` are `streamserve up` (its own embedded Redis-protocol
server, every stage its own process) driven by `streamserve bench` over HTTP streaming
(/generate) and over direct Redis jobs. The engine runs first and is freed before the
pipeline starts: with two cores, both at once would measure contention, not the bus. Targets
(shared/BENCHMARKS.md): pipeline >= 0.9x engine output tok/s, and <= 2 ms added p50
inter-token latency. One JSON line per (workload, system) on stdout, with the ratios on the
pipeline lines; a table on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_engine import print_table, run_engine  # noqa: E402

from benchmarks.engine_args import engine_parser, parse_engine_args  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from cli import bench  # noqa: E402
from cli.workloads import WORKLOADS, Workload, make_workload  # noqa: E402
from gpu_worker import Engine  # noqa: E402
from runtime.embedded_server import EmbeddedRedis  # noqa: E402

READY_TIMEOUT_S = 300
WARM_UP = Workload("warm-up", [[40_100 + i for i in range(64)]] * 4, [8] * 4)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until `url`/health answers 200 (a worker is live); raise if `process` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError("the pipeline was not healthy in time")


def bus_workload_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by `doc`'s first paragraph, with the model, dtype, workload and API
    of the bus benchmarks' clients (bench_bus_cost.py, bench_bus_bytes.py)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", default="mixed-64", choices=WORKLOADS)
    parser.add_argument(
        "--api",
        choices=("openai", "native"),
        default="openai",
        help="the clients' API: openai (/v1/completions, the issue's measurement) or "
        "native (/generate, whose answers carry token ids)",
    )
    return parser


def client_options(url: str, args: argparse.Namespace) -> argparse.Namespace:
    """cli/bench.py's options for a workload against `url` in `args.api`."""
    return bench.build_parser().parse_args(["--url", url, "--api", args.api, "--model", args.model])


@contextlib.contextmanager
def started_pipeline(
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
    log_level: str = "INFO",
    redis_data: Path | None = None,
    up_args: Sequence[str] = (),
    redis_url: str | None = None,
) -> Iterator[tuple[str, str]]:
    """`streamserve up` on its own embedded Redis (or on `redis_url`'s server, a Redis
    Cluster's node too), healthy: yields (its URL, the Redis URL); stopped with SIGTERM on
    exit. `redis_data`: where that server keeps an append-only file (None: nothing on
    disk); `up_args`: more flags for `streamserve up`; the workers get ``--dtype`` where
    `args` has one."""
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(EmbeddedRedis(data_dir=redis_data)).url
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "cli", "up", "--model", args.model,
                   "--redis-url", redis_url, "--port", str(port), "--log-level", log_level,
                   *up_args]  # fmt: skip
        if getattr(args, "dtype", None):
            command.append(f"--worker-arg=--dtype={args.dtype}")
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
        try:
            wait_healthy(url, process)
            yield url, redis_url
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def measure_pipeline(args: argparse.Namespace, via: str, name: str) -> dict:
    """One workload through a freshly started pipeline: like the engine's runs, each starts
    from an empty prefix cache (a pipeline kept up would serve a repeated workload's prompts
    from its cache)."""
    with started_pipeline(args) as (url, redis_url):
        options = bench.build_parser().parse_args(
            ["--url", url] + (["--redis-url", redis_url] if via == "redis" else [])
        )
        # Warm-up on ids no workload uses: first-request costs are not the bus's.
        asyncio.run(bench.run_source(options, WARM_UP))
        (row,) = asyncio.run(bench.run_source(options, make_workload(name)))
        return row


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--workloads", default="mixed-64")
    parser.add_argument("--via", default="http,redis", help="pipeline entry points to measure")
    args = parse_engine_args(parser)
    names = args.workloads.split(",")

    engine_rows = {}
    engine = Engine(args.model, dtype=args.dtype)
    engine.generate(input_ids=[[100] * 64] * 4,
                    sampling_params={"max_new_tokens": 8, "ignore_eos": True})  # fmt: skip
    for name in names:
        engine.flush_cache()
        figures = run_engine(engine, make_workload(name))
        engine_rows[name] = {"workload": name, "system": "engine", **figures}
    del engine
    gc.collect()

    pipeline_rows = [
        measure_pipeline(args, via, name) for via in args.via.split(",") for name in names
    ]
    rows = list(engine_rows.values())
    for row in pipeline_rows:
        base = engine_rows[row["workload"]]
        row["vs_engine"] = round(row["output_tok_s"] / base["output_tok_s"], 3)
        if row.get("itl_ms_p50") is not None and base.get("itl_ms_p50") is not None:
            row["added_itl_ms_p50"] = round(row["itl_ms_p50"] - base["itl_ms_p50"], 2)
        rows.append(row)
    for row in rows:
        row.update(model=args.model, dtype=args.dtype, cpus=os.cpu_count())
        emit(row, args.out)
    print_table(rows)


if __name__ == "__main__":
    main()
