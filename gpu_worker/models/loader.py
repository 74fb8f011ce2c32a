"""Build the model a model argument names on its device, and load its weights.

runtime/model_files.py resolves the argument; here a random shape gets seeded random weights
(random_shapes.py), a GGUF file is converted once into a cached Hugging Face folder
(gguf_convert.py), and a folder needs config.json and *.safetensors (tokenizer files optional).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_convert import convert_gguf
from gpu_worker.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from gpu_worker.models.random_shapes import fill_random_weights, random_shape_config
from runtime.model_files import resolve_model

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None
    source: str  # what was loaded, for logs: a path or "random:<shape>"


def load_model(
    name_or_path: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> LoadedModel:
    """Build the model named by `name_or_path` in `dtype` on `device`, ready for inference."""
    device = torch.device(device)
    resolved = resolve_model(
        name_or_path,
        marker="config.json",
        what="model",
        folder_holds="config.json and *.safetensors",
    )
    if resolved.kind == "random":
        return _load_random(resolved.shape, dtype, device, seed)
    assert resolved.path is not None  # a file or folder for every other kind
    if resolved.kind == "gguf":
        return _load_gguf(resolved.path, dtype, device)
    return _load_hf_folder(resolved.path, dtype, device, source=str(resolved.path.resolve()))


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    folder = convert_gguf(path)
    return _load_hf_folder(folder, dtype, device, source=f"{path.resolve()} (cached: {folder})")


def _load_random(shape: str, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    config = random_shape_config(shape)
    model = _build(config, dtype, device)
    fill_random_weights(model, seed)
    return LoadedModel(_ready(model), config, None, source=f"random:{shape} (seed {seed})")


def _load_hf_folder(
    folder: Path, dtype: torch.dtype, device: torch.device, source: str
) -> LoadedModel:
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    model = _build(config, dtype, device)
    model.load_weights(_iter_safetensors(folder))
    tokenizer = None
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LoadedModel(_ready(model), config, tokenizer, source)


def _build(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    # Allocated in place on the target device and dtype: no float32 copy on the host first.
    return MODEL_REGISTRY[config.architecture].empty(config, dtype, device)


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
