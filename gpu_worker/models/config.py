"""ModelConfig: the shape and numerics of a Llama-family model, parsed from a HF config.json.

Both config.json dialects are read: transformers 4 (`rope_theta`, `rope_scaling`) and
transformers 5 (`rope_parameters` holding theta, type and scaling keys). `to_hf_dict` writes
both, so folders we write load in either version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# architecture name -> HF model_type
ARCHITECTURE_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2: bias on q/k/v. Llama: bias on q/k/v and o (as transformers' `attention_bias`).
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURE_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(ARCHITECTURE_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"rms_norm_eps ({self.rms_norm_eps}) and rope_theta ({self.rope_theta}) "
                "must be positive"
            )
        if self.rope_scaling is not None:
            _validate_rope_scaling(self.rope_scaling)

    @property
    def model_type(self) -> str:
        return ARCHITECTURE_MODEL_TYPES[self.architecture]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a transformers config.json dict (v4 or v5 keys)."""
        architecture = _architecture(d)
        missing = [
            key
            for key in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if d.get(key) is None
        ]
        if missing:
            raise ValueError(f"config is missing required keys: {', '.join(missing)}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim")
        if head_dim is None:
            if d["hidden_size"] % heads:
                raise ValueError(
                    f"hidden_size ({d['hidden_size']}) is not divisible by num_attention_heads "
                    f"({heads}) and the config gives no head_dim"
                )
            head_dim = d["hidden_size"] // heads
        max_positions = d.get("max_position_embeddings", 2048)
        rope_theta, rope_scaling = _parse_rope(d, max_positions)
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            architecture=architecture,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_cap_to_sliding_window(d, architecture, max_positions),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # transformers' Qwen2 hard-codes q/k/v bias; Mistral has none.
            attention_bias=bool(
                d.get("attention_bias", architecture == "Qwen2ForCausalLM")
                and architecture != "MistralForCausalLM"
            ),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers 4 and 5 both load."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope_parameters.update(self.rope_scaling or {})
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_parameters,
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
        elif self.model_type == "qwen2":
            d["use_sliding_window"] = False
        else:
            d["sliding_window"] = None
        if self.torch_dtype is not None:
            d["torch_dtype"] = d["dtype"] = self.torch_dtype
        return d


def _architecture(d: dict[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if architectures:
        return architectures[0]
    by_type = {v: k for k, v in ARCHITECTURE_MODEL_TYPES.items()}
    model_type = d.get("model_type")
    if model_type not in by_type:
        raise ValueError(
            f"unsupported model_type {model_type!r} (config has no 'architectures'); "
            f"supported: {', '.join(by_type)}"
        )
    return by_type[model_type]


def _parse_rope(d: dict[str, Any], max_positions: int) -> tuple[float, dict[str, Any] | None]:
    params = dict(d.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    # v5 keeps theta inside rope_parameters; v4 has it at the top level.
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    scaling = params or dict(d.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # As transformers: llama3 scaling falls back to the model's own context length.
    scaling.setdefault("original_max_position_embeddings", max_positions)
    return theta, {"rope_type": rope_type, **{k: scaling[k] for k in _LLAMA3_KEYS if k in scaling}}


def _validate_rope_scaling(scaling: dict[str, Any]) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type != "llama3":
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


def _cap_to_sliding_window(d: dict[str, Any], architecture: str, max_positions: int) -> int:
    """Our attention is full attention; it equals sliding-window attention up to the window."""
    window = d.get("sliding_window")
    uses_window = architecture == "MistralForCausalLM" or (
        architecture == "Qwen2ForCausalLM" and d.get("use_sliding_window")
    )
    if uses_window and window is not None and window < max_positions:
        logger.warning(
            "sliding_window=%d < max_position_embeddings=%d: capping the context at %d tokens, "
            "where full attention and sliding-window attention agree",
            window,
            max_positions,
            window,
        )
        return int(window)
    return max_positions
