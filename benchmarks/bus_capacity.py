"""Capacity from one bus-load measurement (benchmarks/bench_bus_load.py): how many tokens/s
one core of each stage carries, one Redis shard (a server runs commands on one core), and
so how many workers of a given rate each serves. docs/CAPACITY.md cites this arithmetic.

    python benchmarks/bus_capacity.py results.jsonl [--worker-tok-s 5000]

prints, for each bus-load line of the file, the capacity table in Markdown.

A figure is at 100% of the core: the stage doing nothing else. Plan with headroom (the
CPU per token rises as a core nears saturation, and load is never even).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Per-token CPU each CPU stage should stay under (issue 27): >= 100k tokens/s per core.
TARGET_US_PER_TOKEN = 10.0
# The order of the table's rows; "redis" is the server, the rest are processes.
ROWS = ("redis", "ingress", "detokenizer", "tokenizer", "router", "worker", "clients")


def capacity(cpu_us_per_token: Mapping[str, float], worker_tok_s: float) -> dict[str, Any]:
    """Per stage, from its CPU-µs per token: the tokens/s one core of it carries
    (1e6 / µs), and how many workers making `worker_tok_s` each that core serves."""
    table = {}
    for stage, us in cpu_us_per_token.items():
        tok_s = 1e6 / us if us > 0 else float("inf")
        table[stage] = {
            "cpu_us_per_token": round(us, 2),
            "tok_s_per_core": round(tok_s) if us > 0 else None,
            "workers_per_core": round(tok_s / worker_tok_s, 1) if us > 0 else None,
            "within_target": us <= TARGET_US_PER_TOKEN,
        }
    return {"worker_tok_s": worker_tok_s, "per_core": table}


def markdown(row: Mapping[str, Any], worker_tok_s: float) -> str:
    """The capacity table of one bench_bus_load line, for docs/CAPACITY.md."""
    us = {"redis": row["redis_cpu_us_per_token"], **row["cpu_us_per_token"]}
    us.pop("launcher", None)  # `streamserve up` itself: idle while it supervises
    per_core = capacity(us, worker_tok_s)["per_core"]
    lines = [
        f"| per core of | CPU-µs/token | tokens/s | workers of {worker_tok_s:g} tok/s | "
        f"≤ {TARGET_US_PER_TOKEN:g} µs |",
        "|---|---:|---:|---:|:-:|",
    ]
    for stage in [s for s in ROWS if s in per_core] + sorted(set(per_core) - set(ROWS)):
        figures = per_core[stage]
        name = "Redis shard" if stage == "redis" else stage
        # The clients are the load, not a stage: no target.
        within = "-" if stage == "clients" else "yes" if figures["within_target"] else "no"
        lines.append(
            f"| {name} | {figures['cpu_us_per_token']} | {figures['tok_s_per_core'] or '-'} | "
            f"{figures['workers_per_core'] or '-'} | {within} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a JSONL file bench_bus_load.py wrote")
    parser.add_argument("--worker-tok-s", type=float, default=None,
                        help="the reference worker (default: the line's own)")  # fmt: skip
    args = parser.parse_args()
    for line in args.results.read_text().splitlines():
        row = json.loads(line)
        if row.get("benchmark") != "bus-load":
            continue
        rate = args.worker_tok_s or row["capacity"]["worker_tok_s"]
        print(f"{row.get('date', '')} {row['workers']} workers x {row['worker_tok_s_nominal']} "
              f"tok/s, {row['clients']} clients: {row['tok_s']} tok/s delivered\n")  # fmt: skip
        print(markdown(row, rate) + "\n")


if __name__ == "__main__":
    main()
