"""Known model shapes for `random:<name>`, and deterministic random weights to fill them.

The real shapes let benchmarks run at a real model's cost on machines that cannot download
weights; the tiny ones keep tests fast while still covering each architecture's quirks
(llama3 rope scaling, Qwen2's q/k/v bias, Mistral's GQA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.layers import repack_cpu_weights

_LLAMA3_EOS = [128001, 128008, 128009]


def _llama3_rope_scaling(factor: float, original_context: int) -> dict[str, Any]:
    """Llama 3's rope_scaling entry; its low/high frequency factors are the same in every
    published Llama 3 model."""
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_context,
    }


# A 16-token vocabulary: sampled distributions can be checked with few samples.
_MICRO_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 16,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Written as config.json dicts so they go through the same parser as real checkpoints.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope_scaling(factor=8.0, original_context=8192),
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": _LLAMA3_EOS,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope_scaling(factor=32.0, original_context=8192),
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": _LLAMA3_EOS,
    },
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        # original context below max positions so the scaled band is actually exercised
        "rope_scaling": _llama3_rope_scaling(factor=8.0, original_context=64),
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "micro-llama": _MICRO_LLAMA,
    # Draft models for speculative decoding tests: smaller, same vocabularies as the above.
    "micro-llama-draft": {
        **_MICRO_LLAMA,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    "nano-llama": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 640,
        "hidden_size": 96,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-mistral": {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 768,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def random_shape_config(name: str) -> ModelConfig:
    if name not in RANDOM_SHAPES:
        raise ValueError(
            f"unknown random model shape {name!r}; known shapes: {', '.join(RANDOM_SHAPES)}"
        )
    return ModelConfig.from_hf_dict({**RANDOM_SHAPES[name], "torch_dtype": "bfloat16"})


@torch.no_grad()
def fill_random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter from `seed`: N(0, std) like HF init, norms 1, biases 0.

    The values depend on the seed and on the device's generator (CPU and CUDA differ).
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    # named_parameters yields each tied parameter once, in a fixed order.
    for name, param in model.named_parameters():
        fill_random_(name, param, generator, std)
    repack_cpu_weights(model)  # a model already serving multiplies on packed copies


def fill_random_(name: str, tensor: torch.Tensor, generator: torch.Generator, std: float) -> None:
    """Fill one parameter as fill_random_weights does (a split model's ranks draw the whole
    tensor this way and keep their share, gpu_worker/parallel/loading.py)."""
    if name.endswith("norm.weight"):
        tensor.fill_(1.0)
    elif name.endswith(".bias"):
        tensor.zero_()
    else:
        tensor.normal_(0.0, std, generator=generator)
