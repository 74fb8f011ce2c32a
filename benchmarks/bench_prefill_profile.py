"""Where an in-process prefill spends its time: matmuls, attention, the rest.

    python benchmarks/bench_prefill_profile.py [--workload mixed-64] [--rounds 2]

Prefills every prompt of a workload (one output token each, greedy) through `Engine`, with
the prefix cache cleared before each round, and times on the wall clock each call into a
linear layer (the matmuls: oneDNN, gemm_bf16 or gemm_f32, or the small-row kernel; and
gemm_f32's gate_up product with the activation in it), into each CPU kernel (extend
attention, RMSNorm with or without its residual add, rotary, SiLU-and-mul, the KV write) and
the whole; where the decoder layers run in one C call (gpu_worker/models/fused_layers.py)
that call times the same parts itself. "rest" is what is left: the embedding, copies,
Python per layer (none where the layers are one call) and the scheduler (and residual adds
on torch, where a hook keeps a layer from fusing its add into the next norm). Prints one
JSON line per round (seconds per part, and `outside_matmuls_s`: everything but the
matmuls, issue 30's figure) and a table on stderr.
`--no-amx` keeps extend attention off AMX tiles on a CPU that has them (the before figure).
Run alone on the machine: the parts are wall-clock times.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_args import engine_parser, parse_engine_args  # noqa: E402
from benchmarks.jsonl import emit, machine  # noqa: E402
from cli.workloads import WORKLOADS, make_workload  # noqa: E402
from gpu_worker import Engine  # noqa: E402
from gpu_worker.kernels import cpu_kernels  # noqa: E402
from gpu_worker.models import fused_layers, layers  # noqa: E402

# The kernels a prefill calls, by the part of the table they count in.
KERNEL_PARTS = {
    "extend_attention": "attention",
    "write_kv": "kv_write",
    "rms_norm": "rms_norm",
    "add_rms_norm": "rms_norm",
    "rotary_inplace": "rotary",
    "silu_and_mul": "silu_and_mul",
    # The gate_up product with SiLU·mul in its epilogue (float32 on gemm_f32): a matmul
    # whose activation costs no pass of its own.
    "gemm_silu_mul": "matmuls",
}


class Timers:
    """Seconds per part, from wrappers around the linear layers and the kernels."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.depth = 0  # a kernel a linear layer calls counts in the linear

    def wrap(self, owner: type, name: str, part: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return  # a kernel this version does not have

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self.depth:
                return original(*args, **kwargs)
            self.depth += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - started
                self.depth -= 1

        setattr(owner, name, timed)


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--workload", default="mixed-64", choices=WORKLOADS)
    parser.add_argument("--seed", type=int, default=0, help="the workload's prompts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--no-amx", action="store_true", help="extend attention off AMX tiles where it has them"
    )
    args = parse_engine_args(parser)
    timers = Timers()
    timers.wrap(layers.Linear, "forward", "matmuls")
    for name, part in KERNEL_PARTS.items():
        timers.wrap(cpu_kernels.CpuKernels, name, part)
    workload = make_workload(args.workload, args.seed)
    engine = Engine(model=args.model, dtype=args.dtype)
    kernels = cpu_kernels.load()
    amx = kernels is not None and kernels.use_amx(not args.no_amx)
    params = [{"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}] * len(workload.prompts)
    engine.generate(input_ids=workload.prompts[:2], sampling_params=params[:2])  # warm-up
    # Inside the one-call decoder layers (fused_layers.py) the C code times each part.
    fused_layers.part_seconds = fused = (ctypes.c_double * len(fused_layers.FUSED_PARTS))()
    for round_ in range(args.rounds):
        engine.flush_cache()
        timers.seconds.clear()
        ctypes.memset(fused, 0, ctypes.sizeof(fused))
        started = time.perf_counter()
        engine.generate(input_ids=workload.prompts, sampling_params=params)
        wall = time.perf_counter() - started
        timers.seconds.update(dict(zip(fused_layers.FUSED_PARTS, fused, strict=True)))
        parts = {part: round(seconds, 3) for part, seconds in timers.seconds.most_common()}
        rest = wall - sum(timers.seconds.values())
        row = {
            "benchmark": "prefill-profile",
            "workload": args.workload,
            "seed": args.seed,
            "round": round_,
            "dtype": args.dtype,
            "amx_attention": amx,
            "prompt_tokens": sum(len(p) for p in workload.prompts),
            "wall_s": round(wall, 3),
            "outside_matmuls_s": round(wall - timers.seconds["matmuls"], 3),
            **{f"{part}_s": seconds for part, seconds in parts.items()},
            "rest_s": round(rest, 3),
            **machine(),
            "model": args.model,
        }
        emit(row, args.out)
        table = "  ".join(f"{part} {seconds:.2f}" for part, seconds in parts.items())
        print(f"round {round_}: wall {wall:.2f} s = {table}  rest {rest:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
