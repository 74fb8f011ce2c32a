"""ShardPlan: which rows and columns of each checkpoint tensor a tensor-parallel rank keeps,
read from safetensors without the rest, with the vocabulary padded to equal shares."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpu_worker.models.random_shapes import random_shape_config
from gpu_worker.parallel.shard import ShardPlan, TPShard, even_share


def test_even_share_deals_the_remainder_to_the_first_parts():
    assert [even_share(3, 2, i) for i in range(2)] == [(0, 2), (2, 3)]
    assert [even_share(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_uneven_heads_keep_each_query_group_with_its_key_value_head():
    config = random_shape_config("smollm2-135m")  # 9 query heads, 3 key/value heads, dim 64
    plans = [ShardPlan(config, TPShard(rank, 2)) for rank in (0, 1)]
    assert [(p.num_heads, p.kv_heads) for p in plans] == [(6, 2), (3, 1)]
    assert [p.q_rows for p in plans] == [(0, 6 * 64), (6 * 64, 9 * 64)]
    assert [p.kv_rows for p in plans] == [(0, 2 * 64), (2 * 64, 3 * 64)]


def test_a_vocabulary_that_does_not_divide_is_padded_with_zero_rows(tmp_path):
    config = dataclasses.replace(random_shape_config("tiny-qwen2"), vocab_size=641)
    embed = torch.randn(641, config.hidden_size)
    save_file({"model.embed_tokens.weight": embed}, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        parts = [ShardPlan(config, TPShard(rank, 2)).take("model.embed_tokens.weight",
                                                          f.get_slice("model.embed_tokens.weight"))
                 for rank in (0, 1)]  # fmt: skip
    assert [p.shape[0] for p in parts] == [321, 321]
    assert torch.equal(torch.cat(parts)[:641], embed)
    assert not parts[1][-1].any()  # the padding row


@pytest.mark.parametrize(
    "name, rows, cols",
    [
        ("model.layers.0.self_attn.q_proj.weight", (48, 96), None),  # 6 heads of 16, rank 1
        ("model.layers.0.self_attn.k_proj.bias", (16, 32), None),
        ("model.layers.0.self_attn.o_proj.weight", None, (48, 96)),
        ("model.layers.0.mlp.up_proj.weight", (96, 192), None),
        ("model.layers.0.mlp.down_proj.weight", None, (96, 192)),
        ("model.layers.0.input_layernorm.weight", None, None),
    ],
)
def test_rank_one_takes_its_rows_or_columns(name, rows, cols):
    config = random_shape_config("tiny-qwen2")  # 6 heads, 2 key/value heads, dim 16, MLP 192
    full = torch.randn(256, 256)
    part = ShardPlan(config, TPShard(1, 2)).take(name, full)
    expected = full if rows is None and cols is None else (
        full[rows[0] : rows[1]] if cols is None else full[:, cols[0] : cols[1]]
    )  # fmt: skip
    assert torch.equal(part, expected)


def test_a_tp_above_the_key_value_heads_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's 2 key/value heads"):
        ShardPlan(random_shape_config("tiny-qwen2"), TPShard(0, 3))
