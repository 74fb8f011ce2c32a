"""Convert a GGUF file into a cached Hugging Face folder: config, safetensors, tokenizer.

Every tensor is dequantized to float32 once, so loading afterwards is a plain safetensors
read and nothing of the GGUF's precision is lost. transformers' own GGUF loader
(`modeling_gguf_pytorch_utils.load_gguf_checkpoint`) is the reference for names, config keys
and llama.cpp's Q/K row permutation.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.rotary import compute_inv_freq
from runtime.model_files import build_once, cached_folder, default_cache_dir

logger = logging.getLogger(__name__)

# Part of the cache key: bump when the folder layout or the conversion changes.
_FORMAT_VERSION = 1
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def cached_folder_for(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the conversion of this exact file lives: keyed on path, size and mtime."""
    return cached_folder(gguf_path, Path(cache_dir or default_cache_dir()), _FORMAT_VERSION)


def convert_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Return the HF folder for `gguf_path`, converting it first if it is not cached yet."""
    path = Path(gguf_path).resolve()
    folder = cached_folder_for(path, cache_dir)

    def convert(out_dir: Path) -> None:
        logger.info("converting %s into %s", path, folder)
        _convert_into(path, out_dir)

    return build_once(folder, convert)


def _convert_into(path: Path, out_dir: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(_GGUF_ARCHITECTURES)}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # np.array copies: F32 tensors come back as read-only views of the memory-mapped file.
        tensors[tensor.name] = torch.from_numpy(np.array(weights, dtype=np.float32))
    # Not a weight: llama.cpp's form of Llama 3 rope scaling, folded into the config.
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    config = _model_config(reader, arch, tensors, rope_freqs)
    state_dict = _to_hf_state_dict(tensors, config, permute_qk=arch == "llama")

    save_file(state_dict, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(_dump_json(config.to_hf_dict()))
    # transformers builds a fast tokenizer (with the chat template) from GGUF metadata alone.
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(out_dir)


def _model_config(
    reader: Any, arch: str, tensors: dict[str, torch.Tensor], rope_freqs: torch.Tensor | None
) -> ModelConfig:
    hidden = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = _field(reader, f"{arch}.rope.dimension_count")
    head_dim = head_dim or hidden // heads
    theta = float(_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    d: dict[str, Any] = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, rope_freqs, head_dim, theta),
        # llama.cpp drops output.weight when the head is tied to the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    return ModelConfig.from_hf_dict(d)


def _rope_scaling(
    reader: Any, arch: str, rope_freqs: torch.Tensor | None, head_dim: int, theta: float
) -> dict[str, Any] | None:
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        return {"rope_type": scaling_type}  # ModelConfig rejects what we cannot compute
    if rope_freqs is None:
        return None
    # llama.cpp stores Llama 3.x scaling as per-frequency divisors, not as parameters; find
    # the standard parameter set that reproduces them.
    plain = compute_inv_freq(head_dim, theta, None)
    for factor in (8.0, 16.0, 32.0):
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        if torch.allclose(
            plain / compute_inv_freq(head_dim, theta, scaling), rope_freqs, rtol=1e-3
        ):
            return scaling
    raise ValueError("rope_freqs.weight matches no known llama3 rope scaling")


def _to_hf_state_dict(
    tensors: dict[str, torch.Tensor], config: ModelConfig, permute_qk: bool
) -> dict[str, torch.Tensor]:
    state_dict = {}
    for name, tensor in tensors.items():
        hf_name = gguf_name_to_hf(name)
        if permute_qk and ".q_proj." in hf_name:
            tensor = reverse_llama_permute(tensor, config.num_attention_heads)
        elif permute_qk and ".k_proj." in hf_name:
            tensor = reverse_llama_permute(tensor, config.num_key_value_heads)
        state_dict[hf_name] = tensor.contiguous()
    return state_dict


def gguf_name_to_hf(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def reverse_llama_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (it interleaves each head's rotary halves).

    llama.cpp: w.reshape(n_head, 2, dim, ...).swapaxes(1, 2); this is its inverse, as in
    transformers' LlamaTensorProcessor._reverse_permute_weights.
    """
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _dump_json(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=True) + "\n"
