"""KV pool sizing on a GPU, with the figures of made-up devices."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.memory.gpu_memory import (
    ATTENTION_WORKSPACE_BYTES,
    SAFETY_BYTES,
    forward_activation_bytes,
    plan_gpu_kv_pool,
)
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.random_shapes import RANDOM_SHAPES

GIB = 2**30
LLAMA_8B = ModelConfig.from_hf_dict(RANDOM_SHAPES["llama-3.1-8b"])
KV_PER_TOKEN = TokenToKVPool.bytes_per_token(torch.bfloat16, 32, 8, 128)  # bf16: 128 KiB a token


def test_an_h100_with_an_8b_model_keeps_the_fractions_headroom():
    # 80 GiB, 16 GiB of bf16 weights loaded; the default chunk and batch need ~1 GiB.
    peak = forward_activation_bytes(LLAMA_8B, 2, tokens=2048, logit_rows=256)
    assert peak < GIB
    plan = plan_gpu_kv_pool(80 * GIB, 64 * GIB, 0.85, KV_PER_TOKEN, peak, 0, page_size=1)
    assert KV_PER_TOKEN == 128 * 2**10
    assert plan.headroom_bytes == int(80 * GIB * 0.15)
    assert plan.kv_tokens == (64 * GIB - plan.headroom_bytes) // KV_PER_TOKEN
    assert plan.kv_bytes + plan.headroom_bytes <= 64 * GIB


def test_a_fraction_set_too_high_shrinks_the_pool_instead_of_running_out_later():
    peak = forward_activation_bytes(LLAMA_8B, 2, tokens=8192, logit_rows=1024)
    graphs = 3 * GIB
    plan = plan_gpu_kv_pool(80 * GIB, 64 * GIB, 0.99, KV_PER_TOKEN, peak, graphs, page_size=16)
    needed = peak + graphs + ATTENTION_WORKSPACE_BYTES + SAFETY_BYTES
    assert plan.headroom_bytes == needed > 80 * GIB * 0.01
    assert plan.kv_bytes + needed <= 64 * GIB  # what every forward needs is always left
    assert plan.kv_tokens % 16 == 0


def test_no_room_for_one_page_names_the_figures():
    with pytest.raises(ValueError, match=r"0\.50 GiB free after the weights.*lower"):
        plan_gpu_kv_pool(24 * GIB, GIB // 2, 0.85, KV_PER_TOKEN, GIB, 0, page_size=16)


def test_activations_grow_with_the_chunk_and_the_logits():
    small = forward_activation_bytes(LLAMA_8B, 2, tokens=512, logit_rows=64)
    assert forward_activation_bytes(LLAMA_8B, 2, tokens=2048, logit_rows=64) > small
    assert forward_activation_bytes(LLAMA_8B, 2, tokens=512, logit_rows=512) > small
    # float32 logits beside the model-dtype ones: 6 bytes a logit in bf16
    with_logits = forward_activation_bytes(LLAMA_8B, 2, tokens=0, logit_rows=10)
    assert with_logits == 10 * LLAMA_8B.vocab_size * 6


def test_the_runner_sizes_for_its_largest_forward_verification_included():
    options = {"max_running_requests": 64, "chunked_prefill_size": 64}
    plain = Engine("random:tiny-llama", dtype="float32", **options).runner
    speculative = Engine("random:tiny-llama", dtype="float32", speculative="ngram", **options)
    config = plain.model_config
    assert plain._peak_activation_bytes() == forward_activation_bytes(config, 4, 64, 64)
    # 64 requests verifying 4 drafts each: 320 tokens, every one with logits
    assert speculative.runner._peak_activation_bytes() == forward_activation_bytes(
        config, 4, 320, 320
    )
