"""The model's context length, read from its files without loading it, so the tokenizer
stage can refuse a prompt that cannot fit before the job reaches a worker stream.

A Hugging Face folder states it in config.json (``max_position_embeddings``); a GGUF file in
its header's metadata (``<architecture>.context_length``), which comes before the tensors:
only the header is read, key by key, until the value is found. A ``random:`` model has
neither (None: the worker alone checks). A worker started with a smaller
``--context-length`` still refuses, later, what its own length cannot hold.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import BinaryIO

from runtime.model_files import resolve_model

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct format of a scalar of that type (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
CONFIG_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context_length(model: str) -> int | None:
    """The context length `model` was trained for, or None where its files do not say."""
    resolved = resolve_model(model, marker="tokenizer.json", what="a tokenizer for")
    if resolved.kind == "random" or resolved.path is None:
        return None
    try:
        if resolved.kind == "gguf":
            with open(resolved.path, "rb") as file:
                return gguf_context_length(file)
        config = Path(resolved.path) / "config.json"
        if not config.is_file():
            return None
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, struct.error) as exc:
        # The worker, which loads the model, will say what is wrong with it; here the
        # context check is only skipped.
        logger.warning("cannot read the context length of %s: %s", model, exc)
        return None
    values = {**values.get("text_config", {}), **values}  # multimodal configs nest it
    return next((int(values[key]) for key in CONFIG_KEYS if isinstance(values.get(key), int)),
                None)  # fmt: skip


def gguf_context_length(file: BinaryIO) -> int | None:
    """``<architecture>.context_length`` from a GGUF file's header; None if absent."""
    if file.read(4) != GGUF_MAGIC:
        return None
    _version, _tensors, count = struct.unpack("<IQQ", file.read(20))
    architecture = None
    for _ in range(count):
        key = _string(file)
        kind = _unpack(file, "I")
        if key == "general.architecture" and kind == _STRING:
            architecture = _string(file)
        elif key.endswith(".context_length") and kind in _SCALARS:
            value = _unpack(file, _SCALARS[kind])
            if architecture is None or key == f"{architecture}.context_length":
                return int(value)
        else:
            _skip(file, kind)
    return None


def _unpack(file: BinaryIO, fmt: str):
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, file.read(size))[0]


def _string(file: BinaryIO) -> str:
    return file.read(_unpack(file, "Q")).decode("utf-8", "replace")


def _skip(file: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        file.seek(struct.calcsize("<" + _SCALARS[kind]), 1)
    elif kind == _STRING:
        file.seek(_unpack(file, "Q"), 1)
    elif kind == _ARRAY:
        item_kind, length = _unpack(file, "I"), _unpack(file, "Q")
        if item_kind in _SCALARS:
            file.seek(length * struct.calcsize("<" + _SCALARS[item_kind]), 1)
        else:
            for _ in range(length):
                _skip(file, item_kind)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
