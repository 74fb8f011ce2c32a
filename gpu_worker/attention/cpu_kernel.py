"""Attention on CPU in C kernels over the paged pool (kernels/attention.c and
kernels/extend_attention.c).

Decode: the torch path gathers every request's keys and values into padded copies and
multiplies those, so the cached bytes move three times; the kernel reads each cached row
once, straight from the pool, splitting long requests into key chunks so every thread has
work. Extend (prefill, chunks, draft verification): the torch path attends one request at a
time with copies, masks and small matmuls; the kernel does every request in one call, each
row's softmax over exactly the keys it sees. Shapes the extend kernel does not take (head_dim
not a multiple of 16, more than 8 query heads per kv head) go to the torch path this class
inherits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from gpu_worker.attention.base import AttentionLayer
from gpu_worker.attention.torch_native import TorchNativeAttnBackend
from gpu_worker.kernels.cpu_kernels import CpuKernels
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode

# Keys per work item: long enough to amortize a chunk's setup, short enough that a batch of
# one request still gives each thread several chunks.
MIN_CHUNK, MAX_CHUNK, CHUNK_ALIGN = 32, 256, 32
CHUNKS_PER_THREAD = 8


class FusedAttention(NamedTuple):
    """A batch's attention inputs as this backend's kernels take them (prepare_metadata's)."""

    decode: bool
    kv_pool: TokenToKVPool
    req_to_token: Tensor
    prefix_lens: Tensor  # extend: [bs] int64
    extend_lens: Tensor
    seq_lens: Tensor  # decode: [bs] int64
    chunk: int


class CpuKernelAttnBackend(TorchNativeAttnBackend):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, kernels: CpuKernels
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        self.kernels = kernels
        self._seq_lens = torch.empty(0, dtype=torch.int64)  # on cpu, for the kernel
        self._chunk = MAX_CHUNK
        self._prefix_lens = torch.empty(0, dtype=torch.int64)
        self._extend_lens = torch.empty(0, dtype=torch.int64)
        # Set once the extend kernel declined this model's shape: the torch path from then on.
        self._extend_on_torch = False

    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode != ForwardMode.DECODE:
            if self._extend_on_torch:
                super().prepare_metadata(forward_batch)
            self._prefix_lens = torch.tensor(forward_batch.extend_prefix_lens_cpu)
            self._extend_lens = torch.tensor(forward_batch.extend_seq_lens_cpu)
            return
        lens = forward_batch.seq_lens_cpu
        self._seq_lens = torch.tensor(lens, dtype=torch.int64)
        # Keys, not keys x kv heads: where head_dim is 64 a work item covers every kv head.
        work = sum(lens)
        chunk = -(-work // (CHUNKS_PER_THREAD * torch.get_num_threads()))
        chunk = -(-chunk // CHUNK_ALIGN) * CHUNK_ALIGN
        self._chunk = min(MAX_CHUNK, max(MIN_CHUNK, chunk))

    def fused_attention(self, forward_batch: ForwardBatch) -> FusedAttention | None:
        """What the one-call decoder layers (gpu_worker/models/fused_layers.py) need to
        attend this batch as `forward` would, or None where `forward` attends on torch."""
        decode = forward_batch.forward_mode == ForwardMode.DECODE
        if not decode and self._extend_on_torch:
            return None
        return FusedAttention(
            decode, self.kv_pool, self.req_to_token_pool.req_to_token, self._prefix_lens,
            self._extend_lens, self._seq_lens, self._chunk,
        )  # fmt: skip

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        decode = forward_batch.forward_mode == ForwardMode.DECODE
        if not decode and self._extend_on_torch:
            return super().forward(q, k, v, layer, forward_batch)
        tokens = q.shape[0]
        k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer.layer_id)
        self.kernels.write_kv(k, v, forward_batch.out_cache_loc, k_buffer, v_buffer)
        q = q.view(tokens, layer.num_heads, layer.head_dim)
        if decode:
            out = self._attend_decode_kernel(q, k_buffer, v_buffer, layer, forward_batch)
        else:
            out = self._attend_extend_kernel(q, k_buffer, v_buffer, layer, forward_batch)
        return out.view(tokens, layer.num_heads * layer.head_dim)

    def _attend_decode_kernel(self, q, k_buffer, v_buffer, layer, forward_batch) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)  # q's rows are strided views into qkv
        self.kernels.paged_decode_attention(
            q,
            k_buffer,
            v_buffer,
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            self._seq_lens,
            layer.scaling,
            self._chunk,
            out,
        )
        return out

    def _attend_extend_kernel(self, q, k_buffer, v_buffer, layer, forward_batch) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)
        if self.kernels.extend_attention(
            q,
            k_buffer,
            v_buffer,
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            self._prefix_lens,
            self._extend_lens,
            layer.scaling,
            out,
        ):
            return out
        # The kernel declined this model's shape: the torch path from here on.
        self._extend_on_torch = True
        super().prepare_metadata(forward_batch)
        return self._attend_extend(q, k_buffer, v_buffer, layer)
