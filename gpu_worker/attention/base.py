"""The attention-backend contract.

A backend owns references to the KV pools it reads and writes. Per forward, the
ModelRunner calls `prepare_metadata` once, then each attention layer calls `forward`.
The three graph methods let a CUDA-graph runner capture and replay decode; backends that
cannot be captured leave them raising.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from gpu_worker.model_executor.forward_batch import ForwardBatch


class AttentionLayer(Protocol):
    """What a backend reads of the layer calling it (attention/layer.py's PagedAttention)."""

    layer_id: int  # which layer's K/V in the pool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    @abstractmethod
    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build what every layer's `forward` shares for this batch (indices, masks)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Write k, v into the pool at forward_batch.out_cache_loc, then attend."""

    def init_capture_graph(self, max_batch_size: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, forward_batch: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, forward_batch: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
