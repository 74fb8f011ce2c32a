"""The extend (prefill) attention kernel alone, this tree's against another revision's, or
this tree's on AMX tiles against its AVX512-BF16 path.

    python benchmarks/bench_extend_attention.py [--base e8eacf5 | --amx] [--dtype bfloat16]
        [--runs 9] [--threads 1]

Builds the CPU kernels of `--base` (from `git show`) and of the working tree into two
libraries in a temporary folder (with `--amx`: the tree's alone, run with its AMX tiles off
and on; the CPU must have AMX), then times `extend_attention` on one prefill chunk of
SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64): fresh prompts of
32-512 tokens, as mixed-64's, to about 2,000 tokens, the first continuing a 300-token prefix,
its keys scattered over the pool. The two alternate, `--runs` times each, in one
process; prints both medians and how far the outputs are apart and from a float64
reference. A wall-clock micro-benchmark: on a shared machine the figures are indicative.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_revisions import build, kernels_at  # noqa: E402
from gpu_worker.kernels import cpu_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PREFIX = 9, 3, 64, 300


class Toggled:
    """One library run with its AMX tiles off or on, as the timing loop calls a library."""

    def __init__(self, library: cpu_kernels.CpuKernels, amx: bool) -> None:
        self.library, self.amx = library, amx

    def extend_attention(self, *args) -> bool:
        if self.library.use_amx(self.amx) != self.amx:
            raise SystemExit("--amx: this CPU (or its kernels' build) has no AMX tiles")
        return self.library.extend_attention(*args)


def make_chunk(dtype: torch.dtype, tokens: int = 1900) -> tuple:
    """extend_attention's arguments (less `out`) for one mixed prefill chunk."""
    rng = random.Random(0)
    torch.manual_seed(0)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(rng.randint(32, 512))
    prefix = [PREFIX] + [0] * (len(lens) - 1)
    keys = [p + n for p, n in zip(prefix, lens, strict=True)]
    k_cache = torch.randn(KV_HEADS, sum(keys) + 1, HEAD_DIM).to(dtype)
    v_cache = torch.randn(KV_HEADS, sum(keys) + 1, HEAD_DIM).to(dtype)
    slots = torch.randperm(sum(keys)) + 1
    table = torch.zeros(len(lens), max(keys), dtype=torch.int64)
    start = 0
    for row, count in enumerate(keys):
        table[row, :count] = slots[start : start + count]
        start += count
    qkv = torch.randn(sum(lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype) * 2
    q = qkv[:, : HEADS * HEAD_DIM].view(sum(lens), HEADS, HEAD_DIM)
    return (q, k_cache, v_cache, table, torch.arange(len(lens)), torch.tensor(prefix),
            torch.tensor(lens), HEAD_DIM**-0.5)  # fmt: skip


def reference(args: tuple) -> torch.Tensor:
    """The chunk's attention in float64."""
    q, k_cache, v_cache, table, _, prefix, lens, scale = args
    out, start = [], 0
    for row, (p, n) in enumerate(zip(prefix.tolist(), lens.tolist(), strict=True)):
        slots = table[row, : p + n]
        keys = k_cache[:, slots].double().repeat_interleave(HEADS // KV_HEADS, 0)
        values = v_cache[:, slots].double().repeat_interleave(HEADS // KV_HEADS, 0)
        scores = q[start : start + n].double().transpose(0, 1) @ keys.transpose(1, 2) * scale
        hidden = torch.arange(p + n)[None, :] > (p + torch.arange(n))[:, None]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out.append((probs @ values).transpose(0, 1))
        start += n
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the revision to compare with")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--amx", action="store_true", help="AMX tiles off (base) against on")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    args = make_chunk(getattr(torch, options.dtype))
    with tempfile.TemporaryDirectory() as scratch:
        base_folder = Path(scratch)
        tree = build(ROOT / "gpu_worker/kernels", base_folder / "tree.so")
        if options.amx:
            libraries = {"base": Toggled(tree, False), "tree": Toggled(tree, True)}
        else:
            libraries = {"base": kernels_at(options.base, base_folder), "tree": tree}
        # loaded: the folder may go
    outputs = {name: torch.empty(args[0].shape, dtype=args[0].dtype) for name in libraries}
    times: dict[str, list[float]] = {name: [] for name in libraries}
    for _ in range(options.runs):
        for name, library in libraries.items():
            began = time.perf_counter()
            assert library.extend_attention(*args, outputs[name])
            times[name].append(time.perf_counter() - began)
    expected = reference(args)
    print(f"{args[0].shape[0]} tokens, prompts {args[6].tolist()}, {options.threads} thread(s)")
    apart = (outputs["base"].double() - outputs["tree"].double()).abs()
    print(f"base vs tree: max {apart.max().item():.3g}, mean {apart.mean().item():.3g}")
    for name, runs in times.items():
        error = (outputs[name].double() - expected).abs()
        each = " ".join(f"{t * 1e3:.2f}" for t in runs)
        print(f"{name}: median {statistics.median(runs) * 1e3:.2f} ms ({each}); vs float64 "
              f"max {error.max().item():.3g}, mean {error.mean().item():.3g}")  # fmt: skip


if __name__ == "__main__":
    main()
