"""The tiny transformers configs the model tests build, each stated in one line.

Each test picks its own sizes on purpose (a wide initialisation here, GQA there); what they
share is only which fields a shape and a Llama 3 rope have.
"""

from __future__ import annotations

from typing import Any


def tiny_shape(
    vocab: int, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, **extra: Any
) -> dict[str, Any]:
    """A config's size fields (transformers' names), plus any other fields given."""
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, **extra,
    )  # fmt: skip


def llama3_rope(theta: float, factor: float, original_context: int) -> dict[str, Any]:
    """Llama 3's rope scaling, with its usual frequency factors (1 and 4)."""
    return {
        "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": original_context,
    }  # fmt: skip
