"""Build the model a model argument names on its device, and load its weights.

runtime/model_files.py resolves the argument; here a random shape gets seeded random weights
(random_shapes.py), a GGUF file is converted once into a cached Hugging Face folder
(gguf_convert.py), and a folder needs config.json and *.safetensors (tokenizer.json optional:
without it the model takes token ids only).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_convert import convert_gguf
from gpu_worker.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from gpu_worker.models.random_shapes import fill_random_weights, random_shape_config
from gpu_worker.parallel.shard import ShardPlan, TPShard
from jobs.model_tokenizer import ModelTokenizer
from runtime.model_files import ModelSource, resolve_model

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: ModelTokenizer | None  # the stages' own (jobs/model_tokenizer.py)
    source: str  # what was loaded, for logs: a path or "random:<shape>"


def load_model(
    name_or_path: str,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    shard: TPShard | None = None,
) -> LoadedModel:
    """Build the model named by `name_or_path` in `dtype` on `device`, ready for inference;
    with a `shard` of several ranks, only that rank's share of it (gpu_worker/parallel)."""
    device = torch.device(device)
    resolved = _resolve(name_or_path)
    if resolved.kind == "random":
        return _load_random(resolved.shape, dtype, device, seed, shard)
    assert resolved.path is not None  # a file or folder for every other kind
    if resolved.kind == "gguf":
        return _load_gguf(resolved.path, dtype, device, shard)
    source = str(resolved.path.resolve())
    return _load_hf_folder(resolved.path, dtype, device, source, shard)


def load_model_config(name_or_path: str) -> ModelConfig:
    """The config of the model `name_or_path` names, without its weights (a GGUF file is
    converted, and cached, first: loading it afterwards finds the folder ready)."""
    resolved = _resolve(name_or_path)
    if resolved.kind == "random":
        return random_shape_config(resolved.shape)
    assert resolved.path is not None
    folder = convert_gguf(resolved.path) if resolved.kind == "gguf" else resolved.path
    return ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))


def _resolve(name_or_path: str) -> ModelSource:
    return resolve_model(
        name_or_path,
        marker="config.json",
        what="model",
        folder_holds="config.json and *.safetensors",
    )


def _load_gguf(
    path: Path, dtype: torch.dtype, device: torch.device, shard: TPShard | None = None
) -> LoadedModel:
    folder = convert_gguf(path)
    source = f"{path.resolve()} (cached: {folder})"
    return _load_hf_folder(folder, dtype, device, source, shard)


def _load_random(
    shape: str, dtype: torch.dtype, device: torch.device, seed: int, shard: TPShard | None = None
) -> LoadedModel:
    config = random_shape_config(shape)
    plan = _plan(config, shard)
    model = _build(config, dtype, device, plan)
    if plan is None:
        fill_random_weights(model, seed)
    else:
        from gpu_worker.parallel.loading import random_shares

        model.load_weights(random_shares(plan, dtype, device, seed))
    return LoadedModel(_ready(model), config, None, source=f"random:{shape} (seed {seed})")


def _load_hf_folder(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    shard: TPShard | None = None,
) -> LoadedModel:
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    plan = _plan(config, shard)
    model = _build(config, dtype, device, plan)
    if plan is None:
        model.load_weights(_iter_safetensors(folder))
    else:
        from gpu_worker.parallel.loading import safetensors_shares

        model.load_weights(safetensors_shares(_safetensors_files(folder), plan))
    # Not transformers' AutoTokenizer: its import and load were ~1.7 s of a worker's start.
    tokenizer = ModelTokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    return LoadedModel(_ready(model), config, tokenizer, source)


def _plan(config: ModelConfig, shard: TPShard | None) -> ShardPlan | None:
    """This rank's share of the model, or None when one rank holds all of it."""
    return None if shard is None or shard.size == 1 else ShardPlan(config, shard)


def _build(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, plan: ShardPlan | None = None
) -> LlamaForCausalLM:
    # Allocated in place on the target device and dtype: no float32 copy on the host first.
    return MODEL_REGISTRY[config.architecture].empty(config, dtype, device, plan)


def _ready(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def _iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _safetensors_files(folder)
    total = 0
    for file in files:  # headers only: cheap, and gives the bar a total
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc=f"loading {folder.name}", unit="tensor") as progress:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    progress.update()


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has config.json but no *.safetensors weights")
    return files
