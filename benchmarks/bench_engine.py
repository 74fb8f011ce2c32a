"""Benchmark the in-process engine against transformers on the shared workloads.

    python benchmarks/bench_engine.py [--workloads single,mixed-64] [--out results.jsonl]

Prints one JSON line per (workload, system) on stdout and a table on stderr. Systems:
`engine`, `engine-no-cache` (shared-prefix only), `hf-seq` (single), `hf-batch` (one
left-padded batch of all requests; its output_tok_s counts only the tokens each request
asked for, so it pays for padding as a user would). Every request generates exactly its
output length (end-of-sequence ignored), greedy. Run on an otherwise idle machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_args import engine_parser, parse_engine_args  # noqa: E402
from benchmarks.jsonl import emit as write_line  # noqa: E402
from cli.workloads import WORKLOADS, Workload, make_workload  # noqa: E402
from gpu_worker import Engine  # noqa: E402
from gpu_worker.hf_reference import hf_generate_seconds  # noqa: E402


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_engine(engine: Engine, workload: Workload) -> dict:
    params = [
        {"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in workload.output_lens
    ]
    first: dict[int, float] = {}
    gaps: list[float] = []
    last: dict[int, float] = {}
    start = time.perf_counter()
    tokens = 0
    for chunk in engine.generate_stream(input_ids=workload.prompts, sampling_params=params):
        now = time.perf_counter()
        index = chunk["index"]
        tokens += len(chunk["output_ids"])
        if index not in first:
            first[index] = now - start
        else:
            gaps.append((now - last[index]) / max(len(chunk["output_ids"]), 1))
        last[index] = now
    elapsed = time.perf_counter() - start
    assert tokens == workload.output_tokens, (tokens, workload.output_tokens)
    ttfts = list(first.values())
    result = {
        "output_tok_s": tokens / elapsed,
        "elapsed_s": elapsed,
        "ttft_ms_p50": 1000 * statistics.median(ttfts),
        "itl_ms_p50": 1000 * _percentile(gaps, 0.5) if gaps else None,
        "itl_ms_p99": 1000 * _percentile(gaps, 0.99) if gaps else None,
        "retractions": engine.scheduler.num_retractions,
    }
    if len(workload.prompts) == 1 and len(gaps) > 0:
        result["decode_tok_s"] = 1000 / (1000 * statistics.mean(gaps))
    return result


def run_hf_batch(model, workload: Workload) -> dict:
    elapsed = hf_generate_seconds(model, workload.prompts, max(workload.output_lens))
    return {"output_tok_s": workload.output_tokens / elapsed, "elapsed_s": elapsed}


def run_hf_seq(model, workload: Workload) -> dict:
    elapsed = sum(
        hf_generate_seconds(model, [p], n)
        for p, n in zip(workload.prompts, workload.output_lens, strict=True)
    )
    result = {"output_tok_s": workload.output_tokens / elapsed, "elapsed_s": elapsed}
    if len(workload.prompts) == 1:
        # Decode rate without the prefill: the difference between a long and a 1-token run.
        prompt, n = workload.prompts[0], workload.output_lens[0]
        prefill_only = hf_generate_seconds(model, [prompt], 1)
        result["decode_tok_s"] = (n - 1) / (elapsed - prefill_only)
    return result


def load_hf(model_name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from gpu_worker.models.gguf_convert import convert_gguf
    from runtime.model_files import DEFAULT_MODEL, default_gguf_path

    # The same weights the engine loads: the GGUF file's converted folder, or an HF folder.
    if model_name.lower() == DEFAULT_MODEL:
        folder = convert_gguf(default_gguf_path())
    elif model_name.endswith(".gguf"):
        folder = convert_gguf(Path(model_name))
    else:
        folder = Path(model_name)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--systems", default="engine,hf")
    args = parse_engine_args(parser)
    workloads = [make_workload(name) for name in args.workloads.split(",")]
    systems = set(args.systems.split(","))
    dtype = getattr(torch, args.dtype)

    rows = []

    def emit(workload: Workload, system: str, figures: dict) -> None:
        row = {
            "workload": workload.name,
            "system": system,
            "model": args.model,
            "dtype": args.dtype,
            "requests": len(workload.prompts),
            "output_tokens": workload.output_tokens,
            **figures,
        }
        rows.append(row)
        write_line(row, args.out)

    if "engine" in systems:
        engine = Engine(args.model, dtype=args.dtype)
        engine.generate(
            input_ids=[[100] * 64] * 4, sampling_params={"max_new_tokens": 8, "ignore_eos": True}
        )  # warm-up
        for workload in workloads:
            # Each workload starts from an empty prefix cache, as a fresh server would.
            engine.flush_cache()
            emit(workload, "engine", run_engine(engine, workload))
            if workload.name == "shared-prefix":
                no_cache = Engine(args.model, dtype=args.dtype, disable_radix_cache=True)
                emit(workload, "engine-no-cache", run_engine(no_cache, workload))
                del no_cache
        del engine
    if "hf" in systems:
        model = load_hf(args.model, dtype)
        hf_generate_seconds(model, [[100] * 64] * 4, 8)  # warm-up
        for workload in workloads:
            if len(workload.prompts) == 1:
                emit(workload, "hf-seq", run_hf_seq(model, workload))
            else:
                emit(workload, "hf-batch", run_hf_batch(model, workload))

    print_table(rows)


def print_table(rows: list[dict]) -> None:
    def cell(row: dict, key: str, width: int) -> str:
        value = row.get(key)
        return f"{value:>{width}.1f}" if isinstance(value, float) else f"{'-':>{width}}"

    print(
        f"{'workload':<15}{'system':<17}{'output tok/s':>13}{'ttft p50 ms':>13}"
        f"{'itl p50 ms':>12}{'decode tok/s':>14}",
        file=sys.stderr,
    )
    for row in rows:
        print(
            f"{row['workload']:<15}{row['system']:<17}{cell(row, 'output_tok_s', 13)}"
            f"{cell(row, 'ttft_ms_p50', 13)}{cell(row, 'itl_ms_p50', 12)}"
            f"{cell(row, 'decode_tok_s', 14)}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
