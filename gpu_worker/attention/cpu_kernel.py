"""Attention on CPU with decode in one C kernel over the paged pool (kernels/attention.c).

Decode is where a CPU step spends its attention time: the torch path gathers every
request's keys and values into padded copies and multiplies those, so the cached bytes
move three times; the kernel reads each cached row once, straight from the pool, splitting
long requests into key chunks so every thread has work. Extend (prefill, chunks, draft
verification) is compute-bound and stays on the torch path this class inherits.
"""

from __future__ import annotations

import torch

from gpu_worker.attention.layer import PagedAttention
from gpu_worker.attention.torch_native import TorchNativeAttnBackend
from gpu_worker.kernels.cpu_kernels import CpuKernels
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode

# Keys per work item: long enough to amortize a chunk's setup, short enough that a batch of
# one request still gives each thread several chunks.
MIN_CHUNK, MAX_CHUNK, CHUNK_ALIGN = 32, 256, 32
CHUNKS_PER_THREAD = 8


class CpuKernelAttnBackend(TorchNativeAttnBackend):
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, kernels: CpuKernels
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        self.kernels = kernels
        self._seq_lens = torch.empty(0, dtype=torch.int64)  # on cpu, for the kernel
        self._chunk = MAX_CHUNK

    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode != ForwardMode.DECODE:
            super().prepare_metadata(forward_batch)
            return
        lens = forward_batch.seq_lens_cpu
        self._seq_lens = torch.tensor(lens, dtype=torch.int64)
        work = sum(lens) * self.kv_pool.num_kv_heads
        chunk = -(-work // (CHUNKS_PER_THREAD * torch.get_num_threads()))
        chunk = -(-chunk // CHUNK_ALIGN) * CHUNK_ALIGN
        self._chunk = min(MAX_CHUNK, max(MIN_CHUNK, chunk))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: PagedAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        if forward_batch.forward_mode != ForwardMode.DECODE:
            return super().forward(q, k, v, layer, forward_batch)
        bs = q.shape[0]
        k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer.layer_id)
        self.kernels.write_kv(k, v, forward_batch.out_cache_loc, k_buffer, v_buffer)
        q = q.reshape(bs, layer.num_heads, layer.head_dim).contiguous()
        out = torch.empty_like(q)
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
        return out.view(bs, layer.num_heads * layer.head_dim)
