"""Rotary position embeddings, neox style (rotate_half), computed as transformers' Llama does."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, op for op as transformers computes them;
    on the CPU, also where a model is built on the meta device (LlamaForCausalLM.empty): an
    op on meta tensors imported torch._dynamo, 0.3-0.4 s of a worker's start."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    exponents = exponents.to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_scaling is None:
        return inv_freq
    if rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope scaling type {rope_scaling.get('rope_type')!r}")
    return _llama3_scaled(inv_freq, rope_scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (beyond the original context) are slowed down by `factor`, short ones
    # are kept, and the band between is interpolated smoothly.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.register_buffer(
            "inv_freq", compute_inv_freq(head_dim, rope_theta, rope_scaling), persistent=False
        )

    def reset_inv_freq(self) -> None:
        """Recompute the buffer, e.g. after `to_empty` left it uninitialized."""
        device = self.inv_freq.device
        self.inv_freq = compute_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling).to(
            device
        )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [num_tokens, head_dim] in `dtype`, computed in float32 then cast."""
        if self.inv_freq.dtype != torch.float32:
            # Module.to(dtype) casts buffers too; positions * bf16 frequencies would be far off.
            raise RuntimeError(
                "rotary inv_freq is not float32: cast the model's parameters only (load_model "
                "builds it in the target dtype), or call reset_inv_freq() after .to(dtype)"
            )
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, head_dim]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)
