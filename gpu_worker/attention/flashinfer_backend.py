"""Attention through FlashInfer's paged kernels, with everything around them checkable on CPU.

Per forward the backend builds the batch's page table (paged_metadata.py: device-agnostic
torch), plans once on the first layer, and each layer writes its new K/V into the pool and
runs the planned kernel over the pool read in place (an NHD view of the head-major
buffers: FlashInfer takes the strides). Extends, cached prefix or not, and draft
verification go through the paged prefill kernel with a causal mask aligned to the end of
the keys; decode through the paged decode kernel.

The kernels are a small object with `plan` and `run`. `FlashInferKernels` holds the only
lines that need CUDA and flashinfer-python (the `gpu` extra; imported when it is built, so a
CPU machine never imports it). `ReferenceKernels` runs paged_reference.py instead, on any
device: the backend named `flashinfer_reference` is this whole path with that kernel,
which is how the CPU suite checks the page table, the views and the writes end to end
against transformers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpu_worker.attention.base import AttentionBackend, AttentionLayer
from gpu_worker.attention.paged_metadata import (
    PagedKVMetadata,
    build_paged_kv_metadata,
    paged_kv_view,
)
from gpu_worker.attention.paged_reference import paged_attention_reference
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode

# FlashInfer's float workspace (split-K partial results); its docs allocate 128 MB.
WORKSPACE_BYTES = 128 * 2**20


class ReferenceKernels:
    """plan/run with the plain-torch reference: FlashInfer's contract on any device."""

    def plan(self, meta: PagedKVMetadata, decode: bool, layer: AttentionLayer, dtype) -> None:
        self._meta, self._scale = meta, layer.scaling

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return paged_attention_reference(q, k_pages, v_pages, self._meta, self._scale)

    def init_graphs(self, fixed: PagedKVMetadata) -> None:
        pass  # it reads whatever metadata it was planned with: the fixed buffers' views

    def plan_graph(self, meta: PagedKVMetadata, layer: AttentionLayer, dtype) -> None:
        self.plan(meta, True, layer, dtype)


class FlashInferKernels:
    """FlashInfer's batch decode and prefill wrappers over one workspace (CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        import flashinfer  # the `gpu` extra; only ever imported on CUDA

        self._flashinfer = flashinfer
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        # fa2, not "auto" (which takes fa3 on Hopper): FlashInfer compiles its kernels on
        # first use, and fa3's CUTLASS build takes minutes more at every fresh start.
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend="fa2"
        )
        self._wrapper = self._decode
        self._fixed: PagedKVMetadata | None = None
        self._graph_wrappers: dict[int, object] = {}

    def plan(self, meta: PagedKVMetadata, decode: bool, layer: AttentionLayer, dtype) -> None:
        if decode:
            self._plan_decode(self._decode, meta, layer, dtype)
        else:
            heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
            self._prefill.plan(
                meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, heads,
                kv_heads, dim, meta.page_size, causal=True, sm_scale=layer.scaling,
                q_data_type=dtype, kv_data_type=dtype,
            )  # fmt: skip
            self._wrapper = self._prefill

    def _plan_decode(self, wrapper, meta: PagedKVMetadata, layer: AttentionLayer, dtype) -> None:
        wrapper.plan(
            meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, layer.num_heads,
            layer.num_kv_heads, layer.head_dim, meta.page_size, q_data_type=dtype,
            kv_data_type=dtype, sm_scale=layer.scaling,
        )  # fmt: skip
        self._wrapper = wrapper

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q.contiguous(), (k_pages, v_pages))

    def init_graphs(self, fixed: PagedKVMetadata) -> None:
        self._fixed = fixed

    def plan_graph(self, meta: PagedKVMetadata, layer: AttentionLayer, dtype) -> None:
        """Plan a captured decode: one CUDA-graph wrapper per batch size, over the fixed
        buffers, which its plan fills (the graph reads them at replay)."""
        bs = meta.batch_size
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=self._fixed.kv_indptr[: bs + 1],
                paged_kv_indices_buffer=self._fixed.kv_indices,
                paged_kv_last_page_len_buffer=self._fixed.kv_last_page_len[:bs],
            )  # fmt: skip
            self._graph_wrappers[bs] = wrapper
        self._plan_decode(wrapper, meta, layer, dtype)


class FlashInferAttnBackend(AttentionBackend):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        kernels: ReferenceKernels | FlashInferKernels | None = None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.kernels = kernels if kernels is not None else FlashInferKernels(kv_pool.device)
        self.metadata: PagedKVMetadata | None = None
        self._decode = False
        self._planned = False
        self._layer: AttentionLayer | None = None  # the geometry to plan captures with
        self._fixed: PagedKVMetadata | None = None  # CUDA graphs: buffers replays read

    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        self.metadata = build_paged_kv_metadata(
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens_cpu,
            forward_batch.extend_seq_lens_cpu,
            self.kv_pool.page_size,
        )
        self._decode = forward_batch.forward_mode == ForwardMode.DECODE
        # Planned on the first layer, which brings the head counts and the scale.
        self._planned = False

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        self.kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if not self._planned:
            self.kernels.plan(self.metadata, self._decode, layer, self.kv_pool.dtype)
            self._planned = True
            self._layer = layer
        k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer.layer_id)
        page_size = self.kv_pool.page_size
        tokens = q.shape[0]
        out = self.kernels.run(
            q.view(tokens, layer.num_heads, layer.head_dim).to(self.kv_pool.dtype),
            paged_kv_view(k_buffer, page_size),
            paged_kv_view(v_buffer, page_size),
        )
        return out.reshape(tokens, layer.num_heads * layer.head_dim).to(q.dtype)

    # ---- CUDA graphs: decode metadata in fixed buffers, planned outside the graph ----------

    def init_capture_graph(self, max_batch_size: int) -> None:
        device, page_size = self.kv_pool.device, self.kv_pool.page_size
        pages_per_request = -(-self.req_to_token_pool.max_context_len // page_size)

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self._fixed = PagedKVMetadata(
            zeros(max_batch_size + 1), zeros(max_batch_size + 1),
            zeros(max_batch_size * pages_per_request), zeros(max_batch_size), page_size,
        )  # fmt: skip
        self.kernels.init_graphs(self._fixed)

    def prepare_for_capture(self, forward_batch: ForwardBatch) -> None:
        self.prepare_for_replay(forward_batch)

    def prepare_for_replay(self, forward_batch: ForwardBatch) -> None:
        """The batch's page table copied into the fixed buffers and planned, so the
        captured forward runs without planning (it reads only those buffers)."""
        if self._fixed is None or self._layer is None:
            raise RuntimeError("init_capture_graph and one eager forward come before capture")
        self.prepare_metadata(forward_batch)
        built, fixed, bs = self.metadata, self._fixed, forward_batch.batch_size
        pages = built.kv_indices.shape[0]
        fixed.qo_indptr[: bs + 1].copy_(built.qo_indptr)
        fixed.kv_indptr[: bs + 1].copy_(built.kv_indptr)
        fixed.kv_indices[:pages].copy_(built.kv_indices)
        fixed.kv_last_page_len[:bs].copy_(built.kv_last_page_len)
        self.metadata = PagedKVMetadata(
            fixed.qo_indptr[: bs + 1], fixed.kv_indptr[: bs + 1], fixed.kv_indices[:pages],
            fixed.kv_last_page_len[:bs], fixed.page_size,
        )  # fmt: skip
        self.kernels.plan_graph(self.metadata, self._layer, self.kv_pool.dtype)
        self._planned = True


def flashinfer_reference_backend(
    req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool
) -> FlashInferAttnBackend:
    """The FlashInfer path with the plain-torch kernel: runs anywhere, slowly."""
    return FlashInferAttnBackend(req_to_token_pool, kv_pool, ReferenceKernels())
