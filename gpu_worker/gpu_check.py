"""`streamserve gpu-check`: the GPU path checked and measured on the GPU at hand.

    streamserve gpu-check [--out gpu-check.json] [--parts greedy,ceilings,single,throughput]
                          [--throughput-requests 500]

1. Greedy tokens equal transformers' on the same GPU (or first differ at a near tie) for
   small random Llama, Qwen2 and Mistral models, on each attention path (FlashInfer with
   CUDA graphs, FlashInfer eager, torch_native), with pages of 1 and 16 tokens and a batch
   that crosses captured sizes.
2. The device's two ceilings: device-to-device copy bandwidth and a large bf16 matmul.
3. The `single` decode step on the Llama-3.1-8B shape (random bf16 weights) against the
   bandwidth floor (weight bytes / copy bandwidth), with CUDA graphs on and off.
4. `gpu-throughput` (shared/BENCHMARKS.md) against transformers' padded batches.

A line on stdout and a JSON line in --out as each row is measured (a part that breaks
still leaves the rows before it); a greedy check that raises is its row's error. Without
CUDA it says so and exits 2. Each part is a function of a device, so the CPU suite runs
them small.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_worker.engine import Engine
from gpu_worker.hf_reference import hf_generate_seconds, hf_greedy, is_near_tie
from gpu_worker.models.random_shapes import RANDOM_SHAPES

# Attention paths: engine options on top of the model's.
GPU_PATHS = {
    "flashinfer+graphs": {"attention_backend": "flashinfer", "cuda_graphs": True},
    "flashinfer": {"attention_backend": "flashinfer", "cuda_graphs": False},
    "torch_native": {"attention_backend": "torch_native", "cuda_graphs": False},
}
# 13 requests: past captured sizes 8 and 12, padded to 16.
PROMPT_LENS = (1, 3, 7, 12, 25, 40, 61, 90, 130, 5, 9, 17, 33)
MAX_NEW = 16
HF_BATCH = 16  # transformers' padded batches for gpu-throughput: more would not fit
CHECK_POOL_TOKENS = 8192  # KV pool of the greedy checks' tiny engines
# shared/BENCHMARKS.md's `single` (128 prompt tokens, 256 generated) and `gpu-throughput`
# (500 requests, prompts 256..4096, outputs 64..1024, lengths drawn first). Drawn here: the
# worker side cannot import cli/workloads.py.
SINGLE = (128, 256)
GPU_THROUGHPUT_REQUESTS = 500
PARTS = ("greedy", "ceilings", "single", "throughput")


def gpu_throughput_workload(requests: int = GPU_THROUGHPUT_REQUESTS, seed: int = 0):
    """(prompts, output lengths) of `gpu-throughput`."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(256, 4096) for _ in range(requests)]
    output_lens = [rng.randint(64, 1024) for _ in range(requests)]
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in prompt_lens]
    return prompts, output_lens


def _tiny_hf_model(architecture: str, dtype: torch.dtype, device: str):
    import transformers

    # Head dim 128, the 8B shape's: one FlashInfer kernel build serves both.
    shape = dict(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    config = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[architecture](**shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def check_greedy(
    device: str, dtype: torch.dtype, paths: dict[str, dict], page_sizes=(1, 16)
) -> list[dict]:
    """One row per (architecture, path, page size): greedy equal to transformers? `ok`
    where every request is, or first differs at a near tie (hf_reference.is_near_tie): in
    bfloat16 two right paths round differently, and a tie can go either way."""
    rows = []
    prompts = [[(7 * i + n) % 500 + 3 for i in range(n)] for n in PROMPT_LENS]
    for architecture in ("llama", "qwen2", "mistral"):
        hf_model = _tiny_hf_model(architecture, dtype, device)
        judge = GreedyJudge(hf_model, prompts)
        with tempfile.TemporaryDirectory() as folder:
            hf_model.save_pretrained(folder)
            for path, options in paths.items():
                for page_size in page_sizes:
                    row = {"check": "greedy", "model": architecture, "path": path,
                           "page_size": page_size}  # fmt: skip
                    try:
                        row |= _greedy_row(folder, device, dtype, page_size, options,
                                           prompts, judge)  # fmt: skip
                    except Exception as error:  # one path failing does not hide the others
                        row |= {"equal": False, "ok": False,
                                "error": f"{type(error).__name__}: {error}"}  # fmt: skip
                    _release(device)
                    rows.append(row)
    return rows


class GreedyJudge:
    """transformers' greedy tokens for the prompts, and a verdict on an engine's."""

    def __init__(self, hf_model, prompts: list[list[int]]) -> None:
        self.hf_model, self.exact = hf_model, copy.deepcopy(hf_model).float()
        self.prompts = prompts
        self.expected = hf_greedy(hf_model, prompts, MAX_NEW, stop_at_eos=False)

    def __call__(self, got: list[list[int]]) -> dict:
        differing = [i for i, want in enumerate(self.expected) if got[i] != want]
        ties = 0
        for i in differing:
            want = self.expected[i]
            at = next(n for n, (g, e) in enumerate(zip(got[i], want, strict=True)) if g != e)
            ids = self.prompts[i] + want[:at]
            ties += is_near_tie(self.hf_model, self.exact, ids, got[i][at], want[at])
        return {"equal": not differing, "requests_differing": len(differing),
                "near_ties": ties, "ok": ties == len(differing)}  # fmt: skip


def _greedy_row(folder, device, dtype, page_size, options, prompts, judge) -> dict:
    # A small pool: sized from free memory, each would take the GPU.
    engine = Engine(
        folder, device=device, dtype=str(dtype).removeprefix("torch."),
        page_size=page_size, max_total_tokens=CHECK_POOL_TOKENS, **options,
    )  # fmt: skip
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    results = engine.generate(input_ids=prompts, sampling_params=params)
    return {"serving": engine.runner.serving_path()} | judge([r["output_ids"] for r in results])


def _release(device: str) -> None:
    """Free the last engine now (its runner and graph runner refer to each other)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _seconds(fn, device: str, repeats: int) -> float:
    fn()  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def measure_ceilings(device: str, copy_bytes: int = 2**30, matmul_n: int = 8192) -> dict:
    """Copy bandwidth (GB/s: bytes read plus written) and bf16 matmul rate (TFLOPS)."""
    source = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_s = _seconds(lambda: target.copy_(source), device, 10)
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    matmul_s = _seconds(lambda: a @ b, device, 10)
    return {
        "check": "ceilings",
        "copy_gb_s": 2 * copy_bytes / copy_s / 1e9,
        "bf16_tflops": 2 * matmul_n**3 / matmul_s / 1e12,
    }


def measure_single_decode(device: str, model: str, copy_gb_s: float, graphs: bool) -> dict:
    """The `single` workload's decode step against reading every weight once."""
    _release(device)
    engine = Engine(model, device=device, dtype="bfloat16", cuda_graphs=graphs)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    prompt_len, max_new = SINGLE
    prompt = [[100 + i for i in range(prompt_len)]]
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 8})
    times = [
        time.perf_counter()
        for _ in engine.generate_stream(input_ids=prompt, sampling_params=params)
    ]
    step_ms = 1000 * (times[-1] - times[1]) / (len(times) - 2)  # after the first token
    floor_ms = 1000 * weight_bytes / (copy_gb_s * 1e9 / 2)  # a copy moves each byte twice
    return {
        "check": "single-decode", "model": model, "graphs": graphs,
        "serving": engine.runner.serving_path(), "step_ms": step_ms, "floor_ms": floor_ms,
        "vs_floor": step_ms / floor_ms,
    }  # fmt: skip


def measure_throughput(
    device: str, model: str, prompts: list[list[int]], output_lens: list[int]
) -> list[dict]:
    """Output tok/s of the engine and of transformers' padded batches of HF_BATCH, on the
    same model shape (random weights: speed does not depend on their values)."""
    _release(device)
    engine = Engine(model, device=device, dtype="bfloat16")
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in output_lens]
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    engine_s = time.perf_counter() - start
    del engine
    _release(device)
    hf_s = _hf_batches_seconds(_hf_model_like(model, device), prompts, output_lens)
    tokens = sum(output_lens)
    return [
        {"check": "throughput", "system": "engine", "output_tok_s": tokens / engine_s},
        {"check": "throughput", "system": "hf-batch", "output_tok_s": tokens / hf_s,
         "engine_vs_hf": hf_s / engine_s},
    ]  # fmt: skip


def _hf_model_like(model: str, device: str):
    import transformers

    if model.startswith("random:"):
        config = transformers.AutoConfig.for_model(
            "llama", **RANDOM_SHAPES[model.removeprefix("random:")]
        )
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    return hf.to(device).eval()


def _hf_batches_seconds(hf, prompts: list[list[int]], output_lens: list[int]) -> float:
    return sum(
        hf_generate_seconds(
            hf, prompts[start : start + HF_BATCH], max(output_lens[start : start + HF_BATCH])
        )
        for start in range(0, len(prompts), HF_BATCH)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="streamserve gpu-check", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    parser.add_argument("--model", default="random:llama-3.1-8b", help="for the timings")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")  # fmt: skip
    parser.add_argument("--throughput-requests", type=int, default=GPU_THROUGHPUT_REQUESTS)
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda}"
        print(f"gpu-check needs a CUDA device; torch sees none here ({build})", file=sys.stderr)
        return 2
    rows: list[dict] = []
    with args.out.open("w") as out:

        def report(new_rows: list[dict]) -> None:
            for row in new_rows:
                rows.append(row)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in row.items()), flush=True)  # fmt: skip

        if "greedy" in parts:
            report(check_greedy("cuda", torch.bfloat16, GPU_PATHS))
        copy_gb_s = None
        if "ceilings" in parts or "single" in parts:
            ceilings = measure_ceilings("cuda")
            copy_gb_s = ceilings["copy_gb_s"]
            report([ceilings])
        if "single" in parts:
            for graphs in (True, False):
                report([measure_single_decode("cuda", args.model, copy_gb_s, graphs)])
        if "throughput" in parts:
            workload = gpu_throughput_workload(args.throughput_requests)
            report(measure_throughput("cuda", args.model, *workload))
    return 0 if all(row.get("ok", True) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
