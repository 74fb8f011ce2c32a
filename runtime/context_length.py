"""The model's context length, read from its files without loading it, so a prompt that
cannot fit is refused before the job reaches a worker stream: by the tokenizer stage, and by
the ingress for a prompt of token ids, which it sends past the tokenizer.

A Hugging Face folder states it in config.json (``max_position_embeddings``); a GGUF file in
its header's metadata (``<architecture>.context_length``), which comes before the tensors:
only the header is read, key by key, until the value is found (runtime/gguf_header.py). A
``random:`` model has neither (None: the worker alone checks), nor has a model whose files
are not on this host (`context_length_if_known`, the ingress's: it may run apart from them).
A worker started with a smaller ``--context-length`` still refuses, later, what its own
length cannot hold.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import BinaryIO

from runtime.gguf_header import gguf_metadata
from runtime.model_files import resolve_model

logger = logging.getLogger(__name__)

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


def context_length_if_known(model: str) -> int | None:
    """`model_context_length`, or None where `model` names no files on this host (an
    ingress started with only the served name): the worker then checks the fit alone."""
    try:
        return model_context_length(model)
    except ValueError as exc:
        logger.info("the context length of %s is not known here (%s): workers check it",
                    model, exc)  # fmt: skip
        return None


def gguf_context_length(file: BinaryIO) -> int | None:
    """``<architecture>.context_length`` from a GGUF file's header; None if absent."""
    architecture = None
    for key, value in gguf_metadata(file):
        if key == "general.architecture" and isinstance(value, str):
            architecture = value
        elif key.endswith(".context_length") and isinstance(value, (int, float)):
            if architecture is None or key == f"{architecture}.context_length":
                return int(value)
    return None
