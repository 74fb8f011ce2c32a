"""Attention backends by name, imported lazily so a CPU machine never imports CUDA-only code."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool

logger = logging.getLogger(__name__)

# name -> "module:class"; every backend takes (req_to_token_pool, kv_pool).
_BACKENDS: dict[str, str] = {
    "torch_native": "gpu_worker.attention.torch_native:TorchNativeAttnBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """Turn "auto" into a concrete backend for the device; reject unknown names."""
    if name == "auto":
        return "torch_native"
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is not known; choose one of "
            f"{['auto', *available_backends()]}"
        )
    return name


def create_attention_backend(
    name: str, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool
) -> AttentionBackend:
    module_name, class_name = _BACKENDS[name].split(":")
    factory: Callable[..., AttentionBackend] = getattr(
        importlib.import_module(module_name), class_name
    )
    return factory(req_to_token_pool, kv_pool)
