"""Decode step time with and without a grammar, at batch 1 and 64, in the engine.

    python benchmarks/bench_grammar_step.py [--batches 1,64] [--tokens 128] [--repeats 3]
        [--dtype auto] [--out f.jsonl]

Each run decodes `--tokens` tokens for a batch of the same chat prompt, once free (ignore_eos)
and once per JSON schema long enough never to complete first (arrays of at least 64 strings,
plain or with a maxLength), so every decode step runs the full batch either way. The scheduler's
steps are timed one by one; the figure is the median time of the decode steps whose batch is
full, which covers the grammar's whole cost on the step: the mask filled on CPU, applied to
the logits, and each matcher advanced by its token. Prints one JSON line per (batch,
grammar) with the median over repeats, and each ratio constrained / free (target <= 1.10).
Run on an otherwise idle machine.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_args import engine_parser, parse_engine_args  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from gpu_worker import Engine  # noqa: E402

PROMPT = [{"role": "user", "content": "List as many fruits as you can, as a JSON array."}]
# Arrays of at least 64 strings: plain ones (a mask costs llguidance microseconds), and ones
# with a maxLength, whose counted repetition makes every mask inside a string ~50x dearer.
SCHEMAS = {
    "strings": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    "bounded-strings": {"type": "array", "items": {"type": "string", "maxLength": 12},
                        "minItems": 64},
}  # fmt: skip


def _decode_steps(engine: Engine, batch: int, sampling: dict) -> list[float]:
    """Seconds of each decode step that ran the whole batch."""
    scheduler, timed = engine.scheduler, []
    step = scheduler.step

    def timed_step():
        started = time.perf_counter()
        sampled = step()
        seconds = time.perf_counter() - started
        if (
            sampled is not None
            and len(sampled) == batch
            and all(r.output_ids[:-1] for r in sampled)
        ):
            timed.append(seconds)  # a decode step (each had a token before) of the full batch
        return sampled

    scheduler.step = timed_step
    try:
        engine.generate(messages=[PROMPT] * batch, sampling_params=sampling)
    finally:
        scheduler.step = step
    return timed


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse_engine_args(parser)
    engine = Engine(args.model, dtype=args.dtype)
    free = {"max_new_tokens": args.tokens, "ignore_eos": True, "temperature": 0}
    runs_of = {"free": free}
    for name, schema in SCHEMAS.items():
        runs_of[name] = {"max_new_tokens": args.tokens, "temperature": 0,
                         "json_schema": json.dumps(schema)}  # fmt: skip
        engine.generate(
            messages=[PROMPT] * 2, sampling_params={**runs_of[name], "max_new_tokens": 8}
        )
    for batch in (int(b) for b in args.batches.split(",")):
        medians: dict[str, float] = {}
        for name, sampling in runs_of.items():
            runs = [statistics.median(_decode_steps(engine, batch, sampling))
                    for _ in range(args.repeats)]  # fmt: skip
            medians[name] = statistics.median(runs)
            emit({"bench": "grammar_step", "model": args.model, "dtype": args.dtype, "batch": batch,
                  "grammar": name, "step_ms": round(medians[name] * 1e3, 3),
                  "step_ms_runs": [round(r * 1e3, 3) for r in runs],
                  "cpu": platform.processor() or platform.machine()}, args.out)  # fmt: skip
        for name in SCHEMAS:
            ratio = medians[name] / medians["free"]
            row = {"bench": "grammar_step", "batch": batch, "grammar": name,
                   "ratio": round(ratio, 3), "target": 1.10, "met": ratio <= 1.10}  # fmt: skip
            emit(row, args.out)


if __name__ == "__main__":
    main()
