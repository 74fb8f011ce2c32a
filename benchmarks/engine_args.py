"""The command line the in-process engine benchmarks share: --model, --dtype and --out,
beside each script's own flags, with dtype "auto" resolved as the engine would."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpu_worker.config import EngineConfig


def engine_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of the script's `doc`, with the shared flags;
    the script adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="auto: what the engine would pick")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    return parser


def parse_engine_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    # Resolve "auto" here so a baseline runs in, and the rows record, the engine's dtype.
    args.dtype = EngineConfig(model=args.model, dtype=args.dtype).dtype_name()
    return args
