"""Every benchmark script starts: CI runs no benchmark, so a move that breaks one's imports
would otherwise go unseen until someone measures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("bench_*.py"))


def test_the_benchmarks_are_found():
    assert "bench_engine.py" in SCRIPTS and "bench_peers.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_imports_and_prints_its_help(script):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout
