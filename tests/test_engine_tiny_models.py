"""The correctness anchor on small random Llama, Qwen2 and Mistral models built by transformers."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from gpu_worker import Engine
from gpu_worker.hf_reference import hf_greedy
from tests.tiny_configs import llama3_rope, tiny_shape

MAX_NEW = 20
VOCAB = 512

# A wide init makes the logits peaked, so fp32 rounding cannot flip a greedy choice.
SHAPE = tiny_shape(VOCAB, 96, 192, layers=3, heads=6, kv_heads=2, max_position_embeddings=256,
                   initializer_range=0.2, tie_word_embeddings=False)  # fmt: skip

MODELS = {
    "llama": lambda: transformers.LlamaConfig(
        **SHAPE, rope_parameters=llama3_rope(50000.0, factor=8.0, original_context=64)
    ),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, head_dim=16),
}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny_model_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    config = MODELS[request.param]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if request.param == "qwen2":
        # Random init leaves the q/k/v biases at zero, which would not test that they load.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 3, 7, 12, 25, 40, 61, 90)]
    # Long prompts take the blocked extend path; the second shares 48 tokens with the first,
    # so it extends 180+ tokens after a prefix-cache hit.
    long_prompt = [rng.randrange(VOCAB) for _ in range(230)]
    prompts.append(long_prompt)
    prompts.append(long_prompt[:48] + [rng.randrange(VOCAB) for _ in range(185)])
    return prompts


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"page_size": 16, "chunked_prefill_size": 32},
        {"disable_radix_cache": True},
        # FlashInfer's page table and pool views, the plain-torch kernel in its place.
        {"attention_backend": "flashinfer_reference", "page_size": 16, "chunked_prefill_size": 32},
    ],
)
def test_tiny_model_greedy_equals_transformers(tiny_model_dir, options):
    path, hf_model = tiny_model_dir
    prompts = _prompts()
    reference = hf_greedy(hf_model, prompts, MAX_NEW, stop_at_eos=False)
    engine = Engine(str(path), dtype="float32", **options)
    results = engine.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    )
    assert [r["output_ids"] for r in results] == reference
