"""Attention that reads exactly FlashInfer's page table and paged K/V, in plain torch.

It stands where FlashInfer's kernels stand (gpu_worker/attention/flashinfer_backend.py), on any
device: its answers against the torch_native backend are what prove a PagedKVMetadata
right without a GPU, and on a GPU the same comparison is the start-up self-check. A
request at a time, in float32; a check, not a fast path.
"""

from __future__ import annotations

import torch

from gpu_worker.attention.paged_metadata import PagedKVMetadata


def paged_attention_reference(
    q: torch.Tensor,  # [total query rows, num_heads, head_dim]
    k_pages: torch.Tensor,  # [pages, page_size, kv_heads, head_dim] (NHD; any strides)
    v_pages: torch.Tensor,
    meta: PagedKVMetadata,
    scale: float,
) -> torch.Tensor:  # [total query rows, num_heads, head_dim], q's dtype
    """Causal attention of each request's query rows over its pages. As in FlashInfer, the
    queries are the last rows of the keys: query i of n sees keys 0 .. kv_len - n + i.
    Query head h reads kv head h // (num_heads // kv_heads)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pages.shape[2]
    group = num_heads // kv_heads
    qo_indptr = meta.qo_indptr.tolist()
    kv_indptr = meta.kv_indptr.tolist()
    last_page_len = meta.kv_last_page_len.tolist()
    out = torch.empty_like(q)
    for b in range(meta.batch_size):
        pages = meta.kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        kv_len = (len(pages) - 1) * meta.page_size + last_page_len[b]
        keys = k_pages[pages].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        values = v_pages[pages].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        queries = q[qo_indptr[b] : qo_indptr[b + 1]].float()  # [n, heads, dim]
        n = queries.shape[0]
        keys = keys.repeat_interleave(group, dim=1)  # [kv_len, heads, dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,khd->hnk", queries, keys) * scale
        visible = torch.arange(kv_len, device=q.device)[None, :] <= (
            kv_len - n + torch.arange(n, device=q.device)[:, None]
        )
        scores = scores.masked_fill(~visible, float("-inf"))
        attended = torch.einsum("hnk,khd->nhd", scores.softmax(dim=-1), values)
        out[qo_indptr[b] : qo_indptr[b + 1]] = attended.to(q.dtype)
    return out
