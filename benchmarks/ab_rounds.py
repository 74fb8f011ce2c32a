"""A/B runs of one workload, off and on alternately, and the summary of their medians: the
shape of the benchmarks that measure what one setting costs (metrics, persistence).

Alternating spreads the machine's drift over both settings; medians keep one run's
scheduling luck (this 2-core host moves a run by 10%) out of the ratio.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

Row = dict[str, Any]


def alternate(
    rounds: int, run_once: Callable[[bool], Row], emit_row: Callable[[Row], None]
) -> dict[bool, list[Row]]:
    """`rounds` times: a run off, then on; each row emitted as it comes."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            row = run_once(on)
            runs[on].append(row)
            emit_row(row)
    return runs


def summary(runs: dict[bool, list[dict[str, Any]]], figures: Sequence[str]) -> dict[str, Any]:
    """Each figure's median off and on, and the ratio on / off."""

    def median(on: bool, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[on]), 2)

    out: dict[str, Any] = {"workload": runs[True][0]["workload"], "rounds": len(runs[True])}
    for key in figures:
        off, on = median(False, key), median(True, key)
        out.update({f"{key}_off": off, f"{key}_on": on})
        out[f"on_vs_off_{key}"] = round(on / off, 3) if off else None
    return out


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload and the runs: what both cost benchmarks take alike."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--via", default="http", choices=["http", "redis"])
