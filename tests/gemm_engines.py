"""What an engine on random weights generates greedily with a GEMM kernel's packed weights
and without them (pack_gemm_weight returning None), for tests/test_gemm_bf16.py and
tests/test_gemm_f32.py."""

from __future__ import annotations

import random

import pytest

from gpu_worker import Engine
from gpu_worker.kernels.cpu_kernels import CpuKernels
from gpu_worker.models.layers import Linear
from gpu_worker.models.random_shapes import fill_random_weights


def greedy_with_and_without_gemm(
    monkeypatch: pytest.MonkeyPatch, dtype: str, prompt_lengths: tuple[int, ...]
) -> list[list[list[int]]]:
    """[with, without]: each request's output tokens. Peaked logits (weights of std 0.2), so
    a summation order cannot flip a choice."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in prompt_lengths]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outputs = []
    for use_gemm in (True, False):
        if not use_gemm:
            monkeypatch.setattr(CpuKernels, "pack_gemm_weight", lambda self, weight: None)
        engine = Engine("random:tiny-llama", dtype=dtype)
        fill_random_weights(engine.runner.model, seed=0, std=0.2)  # packs the weights anew
        linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        assert all((m.gemm_weight is not None) == use_gemm for m in linears)
        result = engine.generate(input_ids=prompts, sampling_params=params)
        outputs.append([r["output_ids"] for r in result])
    return outputs
