"""The attention layer the models use: projections stay in the model, this does the rest."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.model_executor.forward_context import get_forward_context


class PagedAttention(nn.Module):
    """Attention over the paged KV pool, delegated to the backend in the ForwardContext."""

    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        return context.attn_backend.forward(q, k, v, self, context.forward_batch)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}"
        )
