"""Speculative decoding against plain decoding, in one run, on the engine.

    python benchmarks/bench_speculative.py [--workloads copy-1,copy-16,mixed-64] [--out f.jsonl]

Workloads (shared/BENCHMARKS.md): `copy-1` runs the 16 `copy` chats one at a time,
`copy-16` all at once (greedy, at most 256 new tokens, stopping at end-of-sequence);
`mixed-64` is the shared token-id workload (exact output lengths). Each workload runs on a
plain engine and on one with n-gram speculation, built once each and warmed up; the line
for the speculative one gives its speed as a ratio of the plain one's, its acceptance, and
whether every output equals the plain one (it must, under greedy sampling). Prints one JSON
line per (workload, system). Run on an otherwise idle machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_args import engine_parser, parse_engine_args  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from cli.workloads import COPY_MAX_NEW_TOKENS, copy_messages, make_workload  # noqa: E402
from gpu_worker import Engine  # noqa: E402

GREEDY = {"temperature": 0.0}


def run(engine: Engine, workload: str) -> tuple[float, list[list[int]]]:
    """Seconds taken and the output ids of every request."""
    started = time.perf_counter()
    if workload == "mixed-64":
        w = make_workload("mixed-64")
        sampling = [{**GREEDY, "max_new_tokens": n, "ignore_eos": True} for n in w.output_lens]
        results = engine.generate(input_ids=w.prompts, sampling_params=sampling)
    else:
        sampling = {**GREEDY, "max_new_tokens": COPY_MAX_NEW_TOKENS}
        chats = copy_messages()
        if workload == "copy-1":
            results = [engine.generate(messages=chat, sampling_params=sampling) for chat in chats]
        else:
            results = engine.generate(messages=chats, sampling_params=sampling)
    return time.perf_counter() - started, [r["output_ids"] for r in results]


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--workloads", default="copy-1,copy-16,mixed-64")
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parse_engine_args(parser)
    engines = {
        "engine": Engine(args.model, dtype=args.dtype),
        "engine-ngram": Engine(args.model, dtype=args.dtype, speculative="ngram",
                               num_draft_tokens=args.num_draft_tokens),
    }  # fmt: skip
    for engine in engines.values():  # first-call costs (oneDNN kernels) out of the figures
        engine.generate(input_ids=[[7] * 40] * 2, sampling_params={"max_new_tokens": 8})
    for workload in args.workloads.split(","):
        baseline: tuple[float, list[list[int]]] | None = None
        for system, engine in engines.items():
            # Each run starts from an empty prefix cache, as the other system did.
            engine.flush_cache()
            drafter = engine.scheduler.drafter
            before = (drafter.drafted, drafter.accepted, drafter.verify_steps) if drafter else None
            seconds, outputs = run(engine, workload)
            tokens = sum(len(ids) for ids in outputs)
            row = {
                "workload": workload,
                "system": system,
                "model": args.model,
                "dtype": args.dtype,
                "output_tokens": tokens,
                "elapsed_s": round(seconds, 2),
                "output_tok_s": round(tokens / seconds, 2),
            }
            if baseline is None:
                baseline = (seconds, outputs)
            else:
                base_seconds, base_outputs = baseline
                base_rate = sum(len(ids) for ids in base_outputs) / base_seconds
                row["vs_engine"] = round(tokens / seconds / base_rate, 3)
                row["outputs_equal"] = sum(
                    a == b for a, b in zip(outputs, base_outputs, strict=True)
                )
                row["outputs"] = len(outputs)
            if drafter is not None and before is not None:
                drafted = drafter.drafted - before[0]
                accepted = drafter.accepted - before[1]
                row["draft_tokens"] = drafted
                row["acceptance"] = round(accepted / drafted, 3) if drafted else None
                # Per request and verify step: the accepted drafts plus the target's token.
                steps = drafter.verify_steps - before[2]
                row["tokens_per_verify"] = round((accepted + steps) / steps, 3) if steps else None
            emit(row, args.out)


if __name__ == "__main__":
    main()
