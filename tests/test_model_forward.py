"""Our Llama-family forward gives transformers' logits for the same weights.

Models run without the KV pool: a test-only attention backend does causal SDPA over the
q/k/v it is handed, one prefill request at a time, so any difference comes from the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor

from gpu_worker.attention.base import AttentionBackend, AttentionLayer
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.model_executor.forward_context import ForwardContext, forward_context
from gpu_worker.models.loader import load_model
from tests.tiny_configs import llama3_rope, tiny_shape


class PrefillSDPABackend(AttentionBackend):
    """Causal attention within each request of an all-prefill batch; no KV cache."""

    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        assert forward_batch.forward_mode == ForwardMode.EXTEND
        assert not any(forward_batch.extend_prefix_lens_cpu), "prefill from position 0 only"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        outputs = []
        lens = forward_batch.extend_seq_lens_cpu
        for q_r, k_r, v_r in zip(q.split(lens), k.split(lens), v.split(lens), strict=True):
            n = q_r.shape[0]
            q_r = q_r.view(n, layer.num_heads, layer.head_dim).transpose(0, 1)
            group = layer.num_heads // layer.num_kv_heads
            k_r = k_r.view(n, layer.num_kv_heads, layer.head_dim).transpose(0, 1)
            v_r = v_r.view(n, layer.num_kv_heads, layer.head_dim).transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q_r,
                k_r.repeat_interleave(group, dim=0),
                v_r.repeat_interleave(group, dim=0),
                is_causal=True,
                scale=layer.scaling,
            )
            outputs.append(out.transpose(0, 1).reshape(n, -1))
        return torch.cat(outputs)


def prefill_logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    """Logits at every position of every prompt, run as one flat batch: [tokens, vocab]."""
    lens = [len(p) for p in prompts]
    num_tokens = sum(lens)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(prompts),
        input_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
        positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]),
        req_pool_indices=torch.arange(len(prompts), dtype=torch.int64),
        seq_lens=torch.tensor(lens, dtype=torch.int64),
        out_cache_loc=torch.arange(num_tokens, dtype=torch.int64),
        seq_lens_cpu=lens,
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(prompts),
    )
    backend = PrefillSDPABackend()
    with torch.inference_mode(), forward_context(ForwardContext(backend, batch)):
        backend.prepare_metadata(batch)
        return model.compute_logits(model(batch.input_ids, batch.positions))


def hf_logits(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt])).logits[0].float()


_COMMON = tiny_shape(300, 64, 160, layers=2, heads=8, kv_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-5)  # fmt: skip
TINY_HF_CONFIGS = {
    # original context below the prompt positions' wavelengths, so most bands are rescaled
    "llama3-rope-tied": lambda: transformers.LlamaConfig(
        **_COMMON,
        tie_word_embeddings=True,
        rope_parameters=llama3_rope(500000.0, factor=8.0, original_context=32),
    ),
    "llama-attention-bias": lambda: transformers.LlamaConfig(**_COMMON, attention_bias=True),
    "qwen2-qkv-bias": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False),
    "mistral-gqa": lambda: transformers.MistralConfig(**_COMMON, head_dim=16, sliding_window=None),
}


def build_hf_model(name: str, folder: Path) -> torch.nn.Module:
    """A tiny transformers model with every weight, norm and bias random, saved to `folder`."""
    torch.manual_seed(0)
    hf_config = TINY_HF_CONFIGS[name]()
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        # HF init leaves norms at 1 and biases at 0, which would hide mistakes in either.
        for param_name, param in hf_model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1 if param_name.endswith(".bias") else 0.08)
    hf_model.save_pretrained(folder)
    return hf_model.eval()


@pytest.mark.parametrize("name", list(TINY_HF_CONFIGS))
def test_logits_match_transformers_for_tiny_random_model(name: str, tmp_path: Path) -> None:
    hf_model = build_hf_model(name, tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cpu").model
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    expected = hf_logits(hf_model, prompt)
    actual = prefill_logits(ours, [prompt])

    assert expected.abs().max() > 1.0, "logits too small for the tolerance to mean anything"
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_requests_in_one_flat_batch_match_each_run_alone(tmp_path: Path) -> None:
    hf_model = build_hf_model("qwen2-qkv-bias", tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cpu").model
    prompts = [[5, 17, 200, 3, 3, 41, 9], [250, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]

    batched = prefill_logits(ours, prompts).split([len(p) for p in prompts])

    for prompt, logits in zip(prompts, batched, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_default_model_logits_match_transformers_gguf_loader(
    hf_default_model: torch.nn.Module,
) -> None:
    loaded = load_model("smollm2-135m-instruct", torch.float32, "cpu")
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )

    expected = hf_logits(hf_default_model, prompt)
    actual = prefill_logits(loaded.model, [prompt])

    # Same weights; only float32 summation order differs (fused projections): ~1e-4 at most.
    torch.testing.assert_close(actual, expected, atol=5e-4, rtol=1e-5)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
