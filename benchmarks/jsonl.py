"""The benchmarks' output: one JSON line per result, on stdout and appended to --out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(row: dict[str, Any], out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as handle:
            handle.write(line + "\n")
