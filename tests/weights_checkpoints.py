"""Small Llama checkpoints for the weight-update tests: two of one shape with different
weights, one with a tensor of the wrong shape, one of another shape, and what a fresh engine
on each answers (the single-version runs every update test compares against)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from tests.tiny_configs import tiny_shape

VOCAB = 256
# A wide init makes the logits peaked, so float32 rounding cannot flip a greedy choice.
SHAPE = tiny_shape(VOCAB, 64, 128, layers=2, heads=4, kv_heads=2, max_position_embeddings=1024,
                   initializer_range=0.2, tie_word_embeddings=False)  # fmt: skip
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def save_checkpoint(folder: Path, seed: int, **changes: int) -> Path:
    """A float32 Llama of SHAPE (with `changes`) and random weights from `seed`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**SHAPE, **changes})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def save_wrong_shape(folder: Path, like: Path) -> Path:
    """`like`'s config, with one weight a row short: what a truncated or mislabelled
    checkpoint looks like."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True)
    shutil.copy(like / "config.json", folder / "config.json")
    tensors = load_file(str(like / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((folder / "config.json").read_text())["intermediate_size"] == 128
    return folder


def expected_outputs(model: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy float32 tokens of a fresh engine on `model`, one list per prompt."""
    from gpu_worker import Engine

    engine = Engine(str(model), dtype="float32")
    try:
        results = engine.generate(
            input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new}
        )
    finally:
        engine.shutdown()
    return [result["output_ids"] for result in results]
