"""The checkpoint tensors one tensor-parallel rank loads: its share of each, never the rest.

From safetensors a rank reads only its rows or columns (`get_slice`), so no rank ever holds
another's weights, even for a moment. A GGUF file is dequantized once into a cached
safetensors folder (models/gguf_convert.py; rank 0 does it before the others start), then
read the same way. A `random:` model draws every whole tensor from the seed exactly as an
unsplit model would (so tp 1 and tp N serve the same weights), one tensor at a time, and
keeps its share of each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.random_shapes import fill_random_
from gpu_worker.parallel.shard import ShardPlan


def safetensors_shares(files: list[Path], plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, this rank's share) of every tensor in `files`."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, plan.take(name, f.get_slice(name))


def random_shares(
    plan: ShardPlan, dtype: torch.dtype, device: torch.device, seed: int, std: float = 0.02
) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, this rank's share) of the weights `fill_random_weights` gives the
    whole model from `seed`: the same draws in the same order, one tensor alive at a time."""
    with torch.device("meta"):
        whole = LlamaForCausalLM(plan.config, dtype)  # names, shapes and order only
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in whole.named_parameters():
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        fill_random_(name, tensor, generator, std)
        for fused, part, shard in whole.stacked_params_mapping:
            if f".{fused}." in name:
                hf_name = name.replace(f".{fused}.", f".{part}.")
                yield hf_name, plan.take(hf_name, tensor[whole._shard_slice(shard)])
        if not any(f".{fused}." in name for fused, _, _ in whole.stacked_params_mapping):
            yield name, plan.take(name, tensor)
