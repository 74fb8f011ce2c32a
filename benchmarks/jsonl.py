"""The benchmarks' output: one JSON line per result, on stdout and appended to --out."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def emit(row: dict[str, Any], out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as handle:
            handle.write(line + "\n")


# The CPU features that change which kernels serve (shared/BENCHMARKS.md: record them).
NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict[str, Any]:
    """This machine's CPU model, its notable flags and its core count (Linux' /proc/cpuinfo),
    to write beside every figure."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    notable = [flag for flag in NOTABLE_FLAGS if flag in flags]
    return {"cpu": model, "cpu_flags": " ".join(notable), "cpus": os.cpu_count()}
