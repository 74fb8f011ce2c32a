"""Attention over the paged KV pool with torch's scaled_dot_product_attention.

Runs on CPU and on any device. Decode gathers every request's keys into one padded
[bs, max_len] block and makes one SDPA call per layer (one call beats bs small ones by far
on CPU); extend makes one call per request, since prompt lengths differ a lot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.attention.layer import PagedAttention
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _DecodeMetadata:
    slots: torch.Tensor  # [bs, max_len] int64: KV slot of every key position (padded)
    mask: torch.Tensor  # [bs, 1, 1, max_len] bool: True where the key is real


@dataclass
class _ExtendSequence:
    token_start: int  # offset of this request's new tokens in the flat token axis
    num_new: int
    slots: torch.Tensor  # [seq_len] int64: KV slots of the whole sequence
    mask: torch.Tensor | None  # [num_new, seq_len] bool; None means plain causal (no prefix)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self._decode: _DecodeMetadata | None = None
        self._extend: list[_ExtendSequence] = []

    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode == ForwardMode.DECODE:
            self._prepare_decode(forward_batch)
        elif forward_batch.forward_mode == ForwardMode.EXTEND:
            self._prepare_extend(forward_batch)

    def _prepare_decode(self, fb: ForwardBatch) -> None:
        max_len = max(fb.seq_lens_cpu)
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices]
        slots = rows[:, :max_len]
        positions = torch.arange(max_len, device=slots.device)
        mask = (positions[None, :] < fb.seq_lens[:, None]).view(fb.batch_size, 1, 1, max_len)
        # Padding positions point at slot 0 of the padding page: real memory, masked out.
        self._decode = _DecodeMetadata(slots=slots.masked_fill(~mask.view_as(slots), 0), mask=mask)

    def _prepare_extend(self, fb: ForwardBatch) -> None:
        table = self.req_to_token_pool.req_to_token
        device = table.device
        sequences = []
        start = 0
        rows = fb.req_pool_indices.tolist()  # host sync (cheap: bs ints)
        for row, num_new, prefix in zip(
            rows, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, strict=True
        ):
            seq_len = prefix + num_new
            mask = None
            if prefix > 0:
                # Query i sits at position prefix + i and sees keys 0 .. prefix + i.
                q_pos = torch.arange(prefix, seq_len, device=device)
                k_pos = torch.arange(seq_len, device=device)
                mask = k_pos[None, :] <= q_pos[:, None]
            sequences.append(_ExtendSequence(start, num_new, table[row, :seq_len], mask))
            start += num_new
        self._extend = sequences

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: PagedAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        self.kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer.layer_id)
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        if forward_batch.forward_mode == ForwardMode.DECODE:
            out = self._attend_decode(q, k_buffer, v_buffer, layer)
        else:
            out = self._attend_extend(q, k_buffer, v_buffer, layer)
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim)

    def _attend_decode(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, layer
    ) -> torch.Tensor:
        meta = self._decode
        keys = k_buffer[meta.slots].transpose(1, 2)  # [bs, kv_heads, max_len, dim]
        values = v_buffer[meta.slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(keys.dtype),  # [bs, heads, 1, dim]
            keys,
            values,
            attn_mask=meta.mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.squeeze(2).to(q.dtype)

    def _attend_extend(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, layer
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for seq in self._extend:
            end = seq.token_start + seq.num_new
            keys = k_buffer[seq.slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, len, dim]
            values = v_buffer[seq.slots].transpose(0, 1).unsqueeze(0)
            queries = q[seq.token_start : end].transpose(0, 1).unsqueeze(0).to(keys.dtype)
            attended = F.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            out[seq.token_start : end] = attended.squeeze(0).transpose(0, 1).to(q.dtype)
        return out
