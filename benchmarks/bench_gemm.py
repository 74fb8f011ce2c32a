"""The matmuls a model's layers make, per row count: gemm_bf16 (or, in float32, gemm_f32)
against oneDNN's packed GEMM and the few-row kernel, with every layer's weights coming from
memory.

    python benchmarks/bench_gemm.py [--model-shape smollm2-135m] [--rows 1,2,8,16,32,56,64,256]
        [--dtype bfloat16|float32] [--base REV]

Builds the layers' weights of a `random:` shape (gpu_worker/models/random_shapes.py: the
qkv, o, gate_up and down projections of every layer, ~212 MB for SmolLM2-135M, more than
any cache), and times one pass over all of them for each row count and path, the paths
alternated, the median of --runs. Prints one JSON line per (rows, path): milliseconds a pass,
GFLOPS, and GB/s of weights read. A path this CPU does not have (gemm_bf16 without
AVX512-BF16, gemm_f32 with AVX-512 or without AVX2) is left out. `--base REV` adds that
revision's gemm kernel (built from `git show`) as the path `gemm_bf16@REV` or
`gemm_f32@REV`, alternated with this tree's: a kernel change's before and after in one
process. Run alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.jsonl import emit, machine  # noqa: E402
from benchmarks.kernel_revisions import kernels_at  # noqa: E402
from gpu_worker.kernels import cpu_kernels  # noqa: E402
from gpu_worker.kernels.cpu_kernels import MAX_SMALL_M  # noqa: E402
from gpu_worker.models.config import ModelConfig  # noqa: E402
from gpu_worker.models.layers import PACKING_ROWS_HINT  # noqa: E402
from gpu_worker.models.random_shapes import RANDOM_SHAPES  # noqa: E402


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) features of one decoder layer's four projections."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", default="smollm2-135m", choices=sorted(RANDOM_SHAPES))
    parser.add_argument("--rows", default="1,2,8,16,32,56,64,256")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--base", help="a revision whose gemm kernel to time beside this tree's")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    kernels = cpu_kernels.load()
    gemms = {}  # path -> the library whose gemm it calls
    config = ModelConfig.from_hf_dict(RANDOM_SHAPES[args.model_shape])
    shapes = layer_shapes(config)
    dtype = getattr(torch, args.dtype)
    gemm_path = "gemm_bf16" if dtype == torch.bfloat16 else "gemm_f32"
    torch.manual_seed(0)
    weights = [
        [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in shapes]
        for _ in range(config.num_hidden_layers)
    ]
    paths = {
        "onednn": [
            [torch.ops.mkldnn._reorder_linear_weight(w, PACKING_ROWS_HINT) for w in ws]
            for ws in weights
        ],  # fmt: skip
    }
    if kernels is not None:
        gemms[gemm_path] = kernels
        if args.base:
            with tempfile.TemporaryDirectory() as scratch:
                gemms[f"{gemm_path}@{args.base}"] = kernels_at(args.base, Path(scratch))
        for path, library in gemms.items():
            gemm = [[library.pack_gemm_weight(w) for w in ws] for ws in weights]
            if all(p is not None for ws in gemm for p in ws):
                paths[path] = gemm
        paths["small_m"] = weights
    weight_bytes = sum(w.numel() * w.element_size() for ws in weights for w in ws)
    flops_per_row = sum(2 * n * k for n, k in shapes) * len(weights)

    def one_pass(path: str, x: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for layer in paths[path]:
            for w, (_, k) in zip(layer, shapes, strict=True):
                if path == "onednn":
                    torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")
                elif path in gemms:
                    gemms[path].gemm(x[k], w, None)
                else:
                    kernels.linear(x[k], w, None)
        return time.perf_counter() - start

    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k, dtype=dtype) for _, k in shapes}
        chosen = [p for p in paths if p != "small_m" or rows <= MAX_SMALL_M]
        times: dict[str, list[float]] = {p: [] for p in chosen}
        for _ in range(2):  # warm-up
            for path in chosen:
                one_pass(path, x)
        for _ in range(args.runs):
            for path in chosen:
                times[path].append(one_pass(path, x))
        for path in chosen:
            seconds = statistics.median(times[path])
            emit({"benchmark": "gemm", "model_shape": args.model_shape, "rows": rows,
                  "path": path, "dtype": args.dtype, "ms": round(seconds * 1e3, 2),
                  "gflops": round(rows * flops_per_row / seconds / 1e9),
                  "weights_gb_s": round(weight_bytes / seconds / 1e9, 1),
                  "threads": torch.get_num_threads(), **machine()}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
