"""What Redis persistence costs the pipeline: the same workload through `streamserve up` with
its embedded server keeping an append-only file (appendfsync everysec, as `streamserve up`
runs it by default) and keeping nothing on disk (as with --no-redis-persistence).

    python benchmarks/bench_persistence_cost.py [--rounds 3] [--requests 16] [--max-tokens 64]
        [--via http] [--data-root DIR] [--out f.jsonl]

Runs alternate off, on, off, on, ... each on a freshly started pipeline with its own
embedded server (a fresh, empty data dir for each run with persistence), so drift of the
machine spreads over both. One JSON line per run, then one with the medians and the ratio
on / off of output tok/s, of p50 inter-token latency and of the CPU seconds the pipeline's
processes used for the workload (the server's own included: it is this process's child),
and the size of the append-only file the workload left. The data dirs go under --data-root,
by default the cache folder where `streamserve up` keeps its own: /tmp is often a tmpfs,
where an fsync costs nothing. Run on an otherwise idle machine (check `uptime`).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ab_rounds import add_workload_arguments, alternate, summary  # noqa: E402
from bench_metrics_cost import pipeline_cpu_seconds, workload  # noqa: E402
from bench_pipeline import WARM_UP, started_pipeline  # noqa: E402

from benchmarks import jsonl  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from cli import bench  # noqa: E402
from runtime.embedded_server import default_data_dir  # noqa: E402

FIGURES = ("output_tok_s", "itl_ms_p50", "pipeline_cpu_s")


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def run_once(args: argparse.Namespace, persistence_on: bool) -> dict:
    data_dir = None
    if persistence_on:
        args.data_root.mkdir(parents=True, exist_ok=True)
        data_dir = Path(tempfile.mkdtemp(prefix="bench-persistence-", dir=args.data_root))
    try:
        with started_pipeline(args, log_level="WARNING", redis_data=data_dir) as (url, redis_url):
            options = bench.build_parser().parse_args(
                ["--url", url] + (["--redis-url", redis_url] if args.via == "redis" else [])
            )
            asyncio.run(bench.run_source(options, WARM_UP))
            cpu_before = pipeline_cpu_seconds()
            (row,) = asyncio.run(
                bench.run_source(options, workload(args.requests, args.max_tokens))
            )
            row["pipeline_cpu_s"] = round(pipeline_cpu_seconds() - cpu_before, 2)
            if persistence_on:
                # Times the server's writes waited 2 s on a slow background fsync: the way
                # everysec can stall the bus itself rather than only cost CPU and disk.
                info = redis.Redis.from_url(redis_url).info("persistence")
                row["aof_delayed_fsync"] = info.get("aof_delayed_fsync")
                row["aof_bytes"] = folder_bytes(data_dir)
    finally:
        if data_dir is not None:
            shutil.rmtree(data_dir, ignore_errors=True)
    row.update(system=f"pipeline-{args.via}", persistence="on" if persistence_on else "off")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument(
        "--data-root",
        type=Path,
        default=default_data_dir().parent,
        help="where the runs' data dirs go (default: the cache folder, %(default)s)",
    )
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    machine = {**jsonl.machine(), "model": args.model, "dtype": args.dtype}
    runs = alternate(args.rounds, lambda on: run_once(args, on),
                     lambda row: emit({**row, **machine}, args.out))  # fmt: skip
    result = {**summary(runs, FIGURES), "system": f"pipeline-{args.via}",
              "aof_bytes": statistics.median(r["aof_bytes"] for r in runs[True])}  # fmt: skip
    emit({**result, **machine}, args.out)


if __name__ == "__main__":
    main()
