"""Which part of the model one tensor-parallel rank holds, and the checkpoint slices it loads.

Megatron's split of a Llama-family layer: q/k/v and gate/up are column-parallel (a rank
computes some heads, some MLP columns), o_proj and down_proj row-parallel (each rank's
partial sum, then one all-reduce), the embedding and lm_head split over the vocabulary.
Norms, rotary tables and biases added after a reduction are replicated.

Key/value heads are dealt out as evenly as they go, and each rank takes the query heads of
its key/value heads (so grouped-query attention stays within a rank). Uneven shares are
allowed: the default model, SmolLM2-135M, has 9 query and 3 key/value heads, which no tp of
2 divides, and one rank with 2 key/value heads beside one with 1 is still exact. A tp above
the key/value head count is refused (a rank would hold no head; replicating heads is not
done). MLP columns are dealt the same way. The vocabulary is split into equal shares of
ceil(vocab / tp) rows, the last one zero-padded, so every rank's logits have one shape for
the all-gather (the padding is cut off after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.models.config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """This process's place among `size` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")


def even_share(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `total` items are dealt into `parts` shares as evenly
    as they go (the first `total % parts` shares get one more)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise ValueError when `config` cannot be split over `tp` ranks, saying why."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if tp > config.num_key_value_heads:
        raise ValueError(
            f"tp {tp} exceeds the model's {config.num_key_value_heads} key/value heads: "
            f"every rank needs at least one; use tp <= {config.num_key_value_heads}"
        )
    if tp > config.intermediate_size:
        raise ValueError(f"tp {tp} exceeds the MLP width {config.intermediate_size}")


class ShardPlan:
    """The sizes of one rank's part of `config`, and how to cut checkpoint tensors for it."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        check_tp(config, shard.size)
        self.config = config
        self.shard = shard
        group = config.num_attention_heads // config.num_key_value_heads
        kv_start, kv_end = even_share(config.num_key_value_heads, shard.size, shard.rank)
        self.kv_heads = kv_end - kv_start
        self.num_heads = self.kv_heads * group
        head_dim = config.head_dim
        self.q_rows = (kv_start * group * head_dim, kv_end * group * head_dim)
        self.kv_rows = (kv_start * head_dim, kv_end * head_dim)
        self.mlp_cols = even_share(config.intermediate_size, shard.size, shard.rank)
        self.intermediate_size = self.mlp_cols[1] - self.mlp_cols[0]
        self.vocab_rows = -(-config.vocab_size // shard.size)  # every rank's padded share
        start = shard.rank * self.vocab_rows
        self.vocab_range = (min(start, config.vocab_size),
                            min(start + self.vocab_rows, config.vocab_size))  # fmt: skip

    @property
    def is_split(self) -> bool:
        return self.shard.size > 1

    def take(self, hf_name: str, tensor: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor `hf_name`. `tensor` is a torch tensor or a
        safetensors slice (`safe_open(...).get_slice(name)`), which reads only the rows or
        columns asked for, so a rank never holds another rank's weights."""
        rows, cols = self._cut(hf_name)
        if rows is None and cols is None:
            part = tensor[:]
        elif cols is None:
            part = tensor[rows[0] : rows[1]]
        else:
            part = tensor[:, cols[0] : cols[1]]
        # A view of a full tensor would keep the whole of it alive.
        part = part.clone() if isinstance(tensor, torch.Tensor) else part
        if _is_vocab(hf_name) and part.shape[0] < self.vocab_rows:
            padding = part.new_zeros((self.vocab_rows - part.shape[0], *part.shape[1:]))
            part = torch.cat([part, padding])
        return part

    def _cut(self, hf_name: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """(rows, columns) of `hf_name` this rank keeps; None: all of them."""
        if _is_vocab(hf_name):
            return self.vocab_range, None
        if ".q_proj." in hf_name:
            return self.q_rows, None
        if ".k_proj." in hf_name or ".v_proj." in hf_name:
            return self.kv_rows, None
        if ".gate_proj." in hf_name or ".up_proj." in hf_name:
            return self.mlp_cols, None
        if hf_name.endswith("o_proj.weight"):
            return None, self.q_rows
        if hf_name.endswith("down_proj.weight"):
            return None, self.mlp_cols
        return None, None  # norms, and o_proj's bias (added once, after the all-reduce)


def _is_vocab(hf_name: str) -> bool:
    return hf_name in ("model.embed_tokens.weight", "lm_head.weight")
