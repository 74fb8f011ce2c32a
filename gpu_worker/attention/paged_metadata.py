"""FlashInfer's page table for a batch, built from the engine's own tables in plain torch.

FlashInfer describes which cached keys each request reads in CSR form (its "page table
layout"): request b owns pages `kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`, all full
except the last, which holds `kv_last_page_len[b]` keys (1 .. page_size); its new tokens
are query rows `qo_indptr[b] : qo_indptr[b + 1]`. A causal mask aligns the queries with the
end of the keys, which is what an extend over a cached prefix needs.

The engine keeps a slot per position instead (ReqToTokenPool), and the allocator puts
position p of a request at offset p % page_size of one of its pages, so a request's pages
are the slots of positions 0, page_size, 2 * page_size, ... divided by page_size.

Everything here is device-agnostic torch, so the CPU suite checks it (tests run a plain
attention that reads exactly this layout against the torch_native backend); the pool is
read in place through a strided view, never copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKVMetadata:
    """One batch's CSR page table, int32 on the pool's device, as FlashInfer's plan takes it."""

    qo_indptr: torch.Tensor  # [bs + 1]: request b's query rows are qo_indptr[b] .. [b + 1]
    kv_indptr: torch.Tensor  # [bs + 1]: request b's pages are kv_indices[kv_indptr[b] ..]
    kv_indices: torch.Tensor  # [total pages]: page numbers in the pool
    kv_last_page_len: torch.Tensor  # [bs]: keys in each request's last page, 1 .. page_size
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.shape[0]


def build_paged_kv_metadata(
    req_to_token: torch.Tensor,  # [rows, width] int64: the KV slot of every position
    req_pool_indices: torch.Tensor,  # [bs] int64, on req_to_token's device
    seq_lens: list[int],  # keys per request once this forward's tokens are written
    qo_lens: list[int],  # new tokens (query rows) per request: 1 each when decoding
    page_size: int,
) -> PagedKVMetadata:
    """The page table for a batch whose new K/V are already in the pool. Lengths come from
    the host (the scheduler has them), so building it needs no device-to-host sync."""
    if len(seq_lens) != len(qo_lens) or len(seq_lens) != req_pool_indices.shape[0]:
        raise ValueError("seq_lens, qo_lens and req_pool_indices must have one entry per request")
    if any(q < 1 or q > s for q, s in zip(qo_lens, seq_lens, strict=True)):
        raise ValueError("every request needs 1 .. seq_len query rows")
    device = req_to_token.device
    pages_per_req = [-(-length // page_size) for length in seq_lens]
    kv_indptr = _exclusive_cumsum(pages_per_req)
    total_pages = kv_indptr[-1]
    counts = torch.tensor(pages_per_req, dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(req_pool_indices, counts, output_size=total_pages)
    starts = torch.tensor(kv_indptr[:-1], dtype=torch.int64, device=device)
    page_in_req = torch.arange(total_pages, device=device) - torch.repeat_interleave(
        starts, counts, output_size=total_pages
    )
    first_slots = req_to_token[rows, page_in_req * page_size]
    last_page_len = [
        length - (pages - 1) * page_size
        for length, pages in zip(seq_lens, pages_per_req, strict=True)
    ]
    return PagedKVMetadata(
        qo_indptr=torch.tensor(_exclusive_cumsum(qo_lens), dtype=torch.int32, device=device),
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32, device=device),
        kv_indices=(first_slots // page_size).to(torch.int32),
        kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32, device=device),
        page_size=page_size,
    )


def paged_kv_view(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """A layer's pool buffer [kv_heads, slots, head_dim] seen as FlashInfer's NHD pages,
    [pages, page_size, kv_heads, head_dim]: a strided view of the same memory (page stride
    page_size * head_dim, head stride slots * head_dim), so nothing is copied per step."""
    kv_heads, slots, head_dim = buffer.shape
    if slots % page_size:
        raise ValueError(f"{slots} slots are not a whole number of {page_size}-token pages")
    return buffer.view(kv_heads, slots // page_size, page_size, head_dim).permute(1, 2, 0, 3)


def _exclusive_cumsum(values: list[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out
