"""What metrics cost the pipeline: the same workload through `streamserve up` with metrics on
(every process publishing to Redis, /metrics scraped every 5 s as Prometheus would) and off
(STREAMSERVE_METRICS=0: every metric a no-op, nothing published, nothing scraped).

    python benchmarks/bench_metrics_cost.py [--rounds 3] [--requests 16] [--max-tokens 64]
        [--via http] [--out f.jsonl]

Runs alternate off, on, off, on, ... each on a freshly started pipeline with its own
embedded Redis, so drift of the machine spreads over both. One JSON line per run, then one
with the medians and the ratio on / off of output tok/s (target >= 0.97) and of p50
inter-token latency, and of the CPU seconds the pipeline's processes used for the workload.
Run on an otherwise idle machine (check `uptime`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ab_rounds import add_workload_arguments, alternate, summary  # noqa: E402
from bench_pipeline import WARM_UP, started_pipeline  # noqa: E402

from benchmarks import jsonl  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from cli import bench  # noqa: E402
from cli.workloads import Workload  # noqa: E402

SCRAPE_INTERVAL_S = 5.0
FIGURES = ("output_tok_s", "itl_ms_p50", "pipeline_cpu_s")


def workload(requests: int, max_tokens: int) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randrange(1_000, 40_000) for _ in range(128)] for _ in range(requests)]
    return Workload(f"uniform-{requests}x{max_tokens}", prompts, [max_tokens] * requests)


def scrape_until(url: str, stop: threading.Event, scrapes: list[float]) -> None:
    """GET /metrics every interval, as Prometheus does; the seconds each scrape took."""
    while not stop.wait(SCRAPE_INTERVAL_S):
        started = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            response.read()
        scrapes.append(time.perf_counter() - started)


def pipeline_cpu_seconds() -> float:
    """CPU seconds used so far by the pipeline's processes (this one's children): a steadier
    measure of the cost than throughput, which one run's scheduling luck moves by 10%."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def run_once(args: argparse.Namespace, metrics_on: bool) -> dict:
    env = {**os.environ, "STREAMSERVE_METRICS": "1" if metrics_on else "0"}
    stop, scrapes = threading.Event(), []
    with started_pipeline(args, env, log_level="WARNING") as (url, redis_url):
        options = bench.build_parser().parse_args(
            ["--url", url] + (["--redis-url", redis_url] if args.via == "redis" else [])
        )
        asyncio.run(bench.run_source(options, WARM_UP))
        if metrics_on:
            threading.Thread(target=scrape_until, args=(url, stop, scrapes), daemon=True).start()
        cpu_before = pipeline_cpu_seconds()
        try:
            (row,) = asyncio.run(
                bench.run_source(options, workload(args.requests, args.max_tokens))
            )
        finally:
            stop.set()
        row["pipeline_cpu_s"] = round(pipeline_cpu_seconds() - cpu_before, 2)
    row.update(system=f"pipeline-{args.via}", metrics="on" if metrics_on else "off")
    if scrapes:
        row["scrapes"] = len(scrapes)
        row["scrape_ms_p50"] = round(1000 * statistics.median(scrapes), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    machine = {**jsonl.machine(), "model": args.model, "dtype": args.dtype}
    runs = alternate(args.rounds, lambda on: run_once(args, on),
                     lambda row: emit({**row, **machine}, args.out))  # fmt: skip
    emit({**summary(runs, FIGURES), "system": f"pipeline-{args.via}", **machine}, args.out)


if __name__ == "__main__":
    main()
