"""Prefill chunks for the extend attention kernels' tests, and their float64 reference."""

from __future__ import annotations

import random

import torch

# (head_dim, heads, kv_heads): SmolLM2's and Llama's shapes, one kv head per query head, 96
# (a last tile group of 32 dimensions), 256 (more query steps than the AMX path holds in
# tiles), dimensions off 32 (16, 80: no AMX tiles), groups past what the kernel holds
# (64, 32, 4).
EXTEND_SHAPES = [
    (64, 9, 3),
    (64, 8, 8),
    (64, 8, 2),
    (128, 16, 2),
    (96, 6, 2),
    (256, 4, 2),
    (16, 4, 2),
    (80, 4, 1),
    (64, 32, 4),
]


def extend_case(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> tuple:
    """extend_attention's arguments (less `out`): six requests, fresh prompts and chunk
    continuations, lengths on and off the 8- and 16-query and 32-key blocks, keys scattered
    over the pool."""
    rng = random.Random(head_dim * heads)
    torch.manual_seed(heads)
    slots = 4000
    k_cache = torch.randn(kv_heads, slots, head_dim, dtype=dtype)
    v_cache = torch.randn(kv_heads, slots, head_dim, dtype=dtype)
    table = torch.tensor([rng.sample(range(slots), 700) for _ in range(6)])
    prefix_lens = torch.tensor([0, 0, 40, 300, 0, 17])
    extend_lens = torch.tensor([1, 37, 8, 65, 256, 3])
    rows = torch.tensor(rng.sample(range(6), 6))
    tokens = int(extend_lens.sum())
    # q as the model hands it over: a column slice of the fused qkv output.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    return q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, 0.125


def reference_extend(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, scale):
    """Causal attention of each request's new queries over its slots, in float64."""
    kv_heads, out, start = k_cache.shape[0], [], 0
    requests = zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist(), strict=True)
    for row, prefix, new in requests:
        slots = table[row, : prefix + new]
        keys, values = k_cache[:, slots].double(), v_cache[:, slots].double()
        queries = q[start : start + new].double()  # [new, heads, dim]
        queries = queries.view(new, kv_heads, -1, q.shape[-1]).permute(1, 2, 0, 3)
        scores = torch.einsum("kgnd,kmd->kgnm", queries, keys) * scale
        seen = torch.arange(prefix + new)[None, :] <= (prefix + torch.arange(new))[:, None]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        attended = torch.einsum("kgnm,kmd->kgnd", probs, values)
        out.append(attended.permute(2, 0, 1, 3).reshape(new, q.shape[1], q.shape[2]))
        start += new
    return torch.cat(out)
