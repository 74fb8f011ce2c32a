"""`streamserve gpu-check` without a GPU: it refuses cleanly, and each of its parts runs on
CPU at a small size (the paths a CPU has: torch_native, and FlashInfer's with its
reference kernel)."""

from __future__ import annotations

import subprocess
import sys

import torch

from gpu_worker import gpu_check
from gpu_worker.hf_reference import is_near_tie


def test_without_cuda_it_says_so_and_exits_2():
    done = subprocess.run(
        [sys.executable, "-m", "cli", "gpu-check"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "needs a CUDA device" in done.stderr


def test_greedy_check_passes_for_every_architecture_path_and_page_size():
    paths = {
        "torch_native": {"attention_backend": "torch_native"},
        "flashinfer_reference": {"attention_backend": "flashinfer_reference"},
    }
    rows = gpu_check.check_greedy("cpu", torch.float32, paths)
    assert len(rows) == 3 * 2 * 2
    assert all(row["equal"] for row in rows), [r for r in rows if not r["equal"]]


def test_timings_run_and_report_against_their_floors():
    ceilings = gpu_check.measure_ceilings("cpu", copy_bytes=2**20, matmul_n=64)
    assert ceilings["copy_gb_s"] > 0 and ceilings["bf16_tflops"] > 0
    single = gpu_check.measure_single_decode("cpu", "random:tiny-llama", 10.0, graphs=False)
    assert single["step_ms"] > 0 and single["vs_floor"] == single["step_ms"] / single["floor_ms"]
    prompts, output_lens = gpu_check.gpu_throughput_workload(requests=4)
    assert len(prompts) == 4 and all(256 <= len(p) <= 4096 for p in prompts)
    rows = gpu_check.measure_throughput("cpu", "random:tiny-llama", [[5] * 20] * 3, [4, 3, 2])
    assert [row["system"] for row in rows] == ["engine", "hf-batch"]
    assert rows[1]["engine_vs_hf"] > 0


def test_greedy_check_in_bfloat16_passes_right_paths_where_ties_may_round_either_way():
    paths = {"torch_native": {"attention_backend": "torch_native"}}
    rows = gpu_check.check_greedy("cpu", torch.bfloat16, paths, page_sizes=(16,))
    assert len(rows) == 3
    assert all(row["ok"] and row["near_ties"] == row["requests_differing"] for row in rows)


def test_greedy_judge_fails_a_token_float32_ranks_clearly_below():
    model = gpu_check._tiny_hf_model("llama", torch.bfloat16, "cpu")
    prompts = [[5, 9, 33, 7], [11, 2]]
    judge = gpu_check.GreedyJudge(model, prompts)
    assert judge([list(out) for out in judge.expected]) == {
        "equal": True, "requests_differing": 0, "near_ties": 0, "ok": True,
    }  # fmt: skip
    with torch.inference_mode():
        logits = judge.exact(torch.tensor([prompts[1]])).logits[0, -1]
    top, worst = logits.argmax().item(), logits.argmin().item()
    assert is_near_tie(model, judge.exact, prompts[1], top, top)
    assert not is_near_tie(model, judge.exact, prompts[1], top, worst)
    wrong = [list(judge.expected[0]), [worst] + judge.expected[1][1:]]
    assert judge(wrong) == {"equal": False, "requests_differing": 1, "near_ties": 0, "ok": False}
