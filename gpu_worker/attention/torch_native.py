"""Attention over the paged KV pool in plain torch: runs on CPU and on any device.

Decode gathers the requests' keys into padded [kv_heads, n, max_len, head_dim] blocks and
attends with two batched matmuls per layer. Requests are grouped by length first, so a
short request is not padded to the longest one: decode attention is memory-bound, and
padding is memory traffic. On CPU that is several times faster
than scaled_dot_product_attention, whose kernel does poorly with one query per sequence.
The gather writes into reused workspace buffers: a fresh multi-megabyte tensor per layer
costs more in page faults than the copy itself.

Extend attends one request at a time, since prompt lengths differ a lot: short extends
through SDPA, long ones in blocks of queries with two matmuls each, where a block sees
only the keys up to its last query, so the masked upper triangle is mostly skipped (on
CPU 1.8x faster than SDPA for 512 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.attention.base import AttentionBackend, AttentionLayer
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode

# A decode group grows while its real keys fill at least this share of its padded block.
MIN_GROUP_FILL = 0.8
MAX_DECODE_GROUPS = 4
# Key lengths are padded up to a multiple of this. oneDNN builds a kernel per matmul shape
# (~0.5 ms on CPU) and caches it; a length that grows by one every step would build new
# kernels every step, while aligned lengths repeat.
DECODE_KEY_ALIGN = 64
# One gather over all kv heads saves calls (it wins on small batches); past this many keys
# a gather per head is faster (measured on CPU: 126 vs 203 us for 21k keys).
GATHER_PER_HEAD_MIN_KEYS = 4096
# Extends with at least this many new tokens attend in query blocks of EXTEND_BLOCK.
MIN_BLOCKED_EXTEND = 192
EXTEND_BLOCK = 128


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | None  # [n] int64: batch rows in this group; None = the whole batch
    size: int
    max_len: int
    slots: torch.Tensor  # [n * max_len] int64: KV slot of every key position, padding -> 0
    bias: torch.Tensor  # [1, n, 1, max_len] float32: 0 for real keys, -inf for padding


def group_by_length(seq_lens: list[int]) -> list[list[int]]:
    """Split batch rows into groups of similar length, longest first (host-side ints)."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    for row in order:
        if groups and len(groups) < MAX_DECODE_GROUPS:
            group = groups[-1]
            longest = seq_lens[group[0]]
            real = sum(seq_lens[i] for i in group) + seq_lens[row]
            if real >= MIN_GROUP_FILL * longest * (len(group) + 1):
                group.append(row)
                continue
        elif groups:
            groups[-1].append(row)
            continue
        groups.append([row])
    return groups


@dataclass
class _ExtendSequence:
    token_start: int  # offset of this request's new tokens in the flat token axis
    num_new: int
    slots: torch.Tensor  # [seq_len] int64: KV slots of the whole sequence
    mask: torch.Tensor | None  # [num_new, seq_len] bool; None means plain causal (no prefix)


class _Workspace:
    """Buffers reused across layers and steps, grown when a batch needs more."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self._workspace = _Workspace()
        self._decode: list[_DecodeGroup] = []
        self._extend: list[_ExtendSequence] = []

    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode == ForwardMode.DECODE:
            self._prepare_decode(forward_batch)
        elif forward_batch.forward_mode.is_extend():
            self._prepare_extend(forward_batch)

    def _prepare_decode(self, fb: ForwardBatch) -> None:
        groups = group_by_length(fb.seq_lens_cpu)
        if len(groups) == 1:
            groups = [list(range(fb.batch_size))]  # keep batch order: no gather of q needed
        table = self.req_to_token_pool.req_to_token
        device = table.device
        self._decode = []
        for rows in groups:
            longest = max(fb.seq_lens_cpu[i] for i in rows)
            max_len = -(-longest // DECODE_KEY_ALIGN) * DECODE_KEY_ALIGN
            lens = torch.tensor([fb.seq_lens_cpu[i] for i in rows], device=device)
            batch_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            slots = table[fb.req_pool_indices[batch_rows], :longest]
            slots = F.pad(slots, (0, max_len - longest))
            real = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            bias = torch.zeros(real.shape, dtype=torch.float32, device=device)
            bias.masked_fill_(~real, float("-inf"))
            self._decode.append(
                _DecodeGroup(
                    rows=None if len(groups) == 1 else batch_rows,
                    size=len(rows),
                    max_len=max_len,
                    # Padding positions read slot 0 of the padding page: real memory, masked.
                    slots=slots.masked_fill(~real, 0).reshape(-1),
                    bias=bias.view(1, len(rows), 1, max_len),
                )
            )

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
        self, q: Tensor, k: Tensor, v: Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> Tensor:
        num_tokens = q.shape[0]
        self.kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buffer, v_buffer = self.kv_pool.get_kv_buffer(layer.layer_id)
        if forward_batch.forward_mode == ForwardMode.DECODE:
            out = self._attend_decode(q, k_buffer, v_buffer, layer)
        else:
            out = self._attend_extend(q, k_buffer, v_buffer, layer)
        return out.reshape(num_tokens, layer.num_heads * layer.head_dim)

    def _attend_decode(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, layer
    ) -> torch.Tensor:
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        group_size = layer.num_heads // kv_heads
        # Query head h reads kv head h // group_size, as transformers' repeat_kv lays them out.
        q = q.view(-1, kv_heads, group_size, dim)
        if len(self._decode) == 1:
            return self._attend_decode_group(q, k_buffer, v_buffer, layer, self._decode[0])
        out = torch.empty_like(q)
        for group in self._decode:
            queries = q.index_select(0, group.rows)
            attended = self._attend_decode_group(queries, k_buffer, v_buffer, layer, group)
            out.index_copy_(0, group.rows, attended)
        return out

    def _attend_decode_group(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, layer, group
    ) -> torch.Tensor:
        """q: [n, kv_heads, group_size, dim] -> [n, kv_heads, group_size, dim]."""
        n, max_len = group.size, group.max_len
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        shape = (kv_heads, n * max_len, dim)
        keys = self._workspace.get("keys", shape, k_buffer)
        values = self._workspace.get("values", shape, v_buffer)
        if n * max_len >= GATHER_PER_HEAD_MIN_KEYS:
            for head in range(kv_heads):
                torch.index_select(k_buffer[head], 0, group.slots, out=keys[head])
                torch.index_select(v_buffer[head], 0, group.slots, out=values[head])
        else:
            torch.index_select(k_buffer, 1, group.slots, out=keys)
            torch.index_select(v_buffer, 1, group.slots, out=values)
        keys = keys.view(kv_heads, n, max_len, dim)
        values = values.view(kv_heads, n, max_len, dim)
        queries = q.transpose(0, 1).to(keys.dtype)  # [kv_heads, n, group_size, dim]
        # [kv_heads, n, group, max_len], in float32 (see _exact_scores)
        scores = torch.matmul(_exact_scores(queries), _exact_scores(keys).transpose(-1, -2))
        scores = scores.float().mul_(layer.scaling).add_(group.bias)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [kv_heads, n, group_size, dim]
        return out.transpose(0, 1).to(q.dtype)

    def _attend_extend(
        self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, layer
    ) -> torch.Tensor:
        q = q.view(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        for seq in self._extend:
            end = seq.token_start + seq.num_new
            keys = k_buffer[:, seq.slots]  # [kv_heads, seq_len, dim]
            values = v_buffer[:, seq.slots]
            queries = q[seq.token_start : end].to(keys.dtype)  # [num_new, heads, dim]
            if seq.num_new >= MIN_BLOCKED_EXTEND:
                attended = _blocked_causal_attention(queries, keys, values, layer)
            else:
                attended = (
                    F.scaled_dot_product_attention(
                        queries.transpose(0, 1).unsqueeze(0),
                        keys.unsqueeze(0),
                        values.unsqueeze(0),
                        attn_mask=seq.mask,
                        is_causal=seq.mask is None,
                        scale=layer.scaling,
                        enable_gqa=layer.num_heads != layer.num_kv_heads,
                    )
                    .squeeze(0)
                    .transpose(0, 1)
                )
            out[seq.token_start : end] = attended.to(q.dtype)
        return out


def _blocked_causal_attention(
    queries: torch.Tensor,  # [num_new, heads, dim]: the last num_new positions of the sequence
    keys: torch.Tensor,  # [kv_heads, seq_len, dim]
    values: torch.Tensor,  # [kv_heads, seq_len, dim]
    layer: AttentionLayer,
) -> torch.Tensor:  # [num_new, heads, dim]
    num_new = queries.shape[0]
    kv_heads, seq_len, dim = keys.shape
    group = layer.num_heads // kv_heads
    prefix = seq_len - num_new
    # [kv_heads, group, num_new, dim]: query head h reads kv head h // group.
    grouped = queries.view(num_new, kv_heads, group, dim).permute(1, 2, 0, 3)
    out = torch.empty_like(grouped)
    exact_keys = _exact_scores(keys)
    for start in range(0, num_new, EXTEND_BLOCK):
        stop = min(start + EXTEND_BLOCK, num_new)
        rows = stop - start
        visible = prefix + stop  # keys this block's last query may see
        block = grouped[:, :, start:stop].reshape(kv_heads, group * rows, dim)
        scores = torch.matmul(_exact_scores(block), exact_keys[:, :visible].transpose(-1, -2))
        scores = scores.float().mul_(layer.scaling).view(kv_heads, group, rows, visible)
        # Every query of the block sees all keys before the block's own; only the block's
        # own keys ([rows, rows] at the end) need the causal mask.
        future = torch.ones(rows, rows, dtype=torch.bool, device=keys.device).triu_(1)
        scores[..., visible - rows :].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        attended = torch.matmul(probs.view(kv_heads, group * rows, visible), values[:, :visible])
        out[:, :, start:stop] = attended.view(kv_heads, group, rows, dim)
    return out.permute(2, 0, 1, 3).reshape(num_new, kv_heads * group, dim)


def _exact_scores(operand: torch.Tensor) -> torch.Tensor:
    """An operand of q·k in float32. A bfloat16 matmul rounds each score to 8 bits, an
    error of ~1% in every probability at scores near 10: bfloat16 greedy then diverged
    from transformers' beyond a near tie, where the C kernels, FlashInfer and SDPA (scores
    in float32) did not, and right kernels differed from this path by 1% per layer instead
    of 0.33%. It is the reference the others are checked against, so it pays the copy."""
    return operand if operand.dtype == torch.float32 else operand.float()
