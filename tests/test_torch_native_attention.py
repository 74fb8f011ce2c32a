"""The torch-native backend's own attention paths against SDPA on the same tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.attention.layer import PagedAttention
from gpu_worker.attention.torch_native import (
    EXTEND_BLOCK,
    _blocked_causal_attention,
    group_by_length,
)


@pytest.mark.parametrize("prefix, num_new", [(0, 300), (37, 260), (200, EXTEND_BLOCK + 1)])
def test_blocked_causal_attention_equals_sdpa(prefix, num_new):
    torch.manual_seed(0)
    heads, kv_heads, dim = 6, 2, 16
    layer = PagedAttention(0, heads, kv_heads, dim, scaling=dim**-0.5)
    seq_len = prefix + num_new
    queries = torch.randn(num_new, heads, dim)
    keys = torch.randn(kv_heads, seq_len, dim)
    values = torch.randn(kv_heads, seq_len, dim)
    q_pos = torch.arange(prefix, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    expected = F.scaled_dot_product_attention(
        queries.transpose(0, 1).unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=mask,
        scale=layer.scaling,
        enable_gqa=True,
    )
    got = _blocked_causal_attention(queries, keys, values, layer)
    torch.testing.assert_close(got, expected.squeeze(0).transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_decode_groups_cover_every_row_once_and_keep_padding_bounded():
    lens = [700, 690, 30, 500, 45, 510, 33, 680, 100, 120]
    groups = group_by_length(lens)
    assert sorted(row for group in groups for row in group) == list(range(len(lens)))
    assert len(groups) > 1
    for group in groups[:-1]:
        longest = max(lens[i] for i in group)
        assert sum(lens[i] for i in group) >= 0.8 * longest * len(group)


def test_equal_lengths_make_one_group():
    assert group_by_length([64] * 10) == [list(range(10))]
