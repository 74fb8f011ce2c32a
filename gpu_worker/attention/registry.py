"""Attention backends by name, imported lazily so a CPU machine never imports CUDA-only code."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.kernels.cpu_kernels import CpuKernels
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool

logger = logging.getLogger(__name__)

# name -> "module:class"; every backend takes (req_to_token_pool, kv_pool), and those in
# _NEEDS_CPU_KERNELS the loaded CPU kernels too.
_BACKENDS: dict[str, str] = {
    "torch_native": "gpu_worker.attention.torch_native:TorchNativeAttnBackend",
    "cpu_kernel": "gpu_worker.attention.cpu_kernel:CpuKernelAttnBackend",
    # FlashInfer's paged kernels (CUDA and the `gpu` extra), and the same path with a
    # plain-torch kernel in their place, which runs anywhere (it is how CPU checks it).
    "flashinfer": "gpu_worker.attention.flashinfer_backend:FlashInferAttnBackend",
    "flashinfer_reference": "gpu_worker.attention.flashinfer_backend:flashinfer_reference_backend",
}
# Backends that take the CPU kernels as a third argument.
_NEEDS_CPU_KERNELS = {"cpu_kernel"}
_NEEDS_CUDA = {"flashinfer"}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device: torch.device, cpu_kernels: bool) -> str:
    """Turn "auto" into a concrete backend for the device; reject unknown names and
    backends this device cannot run."""
    if name == "auto":
        if device.type == "cpu" and cpu_kernels:
            return "cpu_kernel"
        # On CUDA FlashInfer where the `gpu` extra is installed (not imported here); the
        # runner serves it only once it passes its start-up self-check.
        if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
            return "flashinfer"
        if device.type == "cuda":
            # torch_native cannot be captured in CUDA graphs: each decode step is hundreds of
            # launches from Python (SmolLM2-135M on an H200: 20 ms a step, slower than two
            # CPU cores; with FlashInfer and graphs the pipeline served 8x the tokens/s).
            logger.warning(
                "flashinfer-python is not installed: attention torch_native, decoding eager "
                "(no CUDA graphs), several times slower; pip install 'streamserve[gpu]'"
            )
        return "torch_native"
    if name in _NEEDS_CPU_KERNELS and not (device.type == "cpu" and cpu_kernels):
        raise ValueError(
            f"attention_backend {name!r} needs the CPU kernels on a CPU device; they are off "
            "or could not be built here (see the log), or the device is not a CPU"
        )
    if name in _NEEDS_CUDA and device.type != "cuda":
        raise ValueError(
            f"attention_backend {name!r} needs a CUDA device and flashinfer-python (pip "
            "install 'streamserve[gpu]'); 'flashinfer_reference' runs its page table and "
            "KV layout with a plain-torch kernel on any device"
        )
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend {name!r} is not known; choose one of "
            f"{['auto', *available_backends()]}"
        )
    return name


def create_attention_backend(
    name: str,
    req_to_token_pool: ReqToTokenPool,
    kv_pool: TokenToKVPool,
    cpu_kernels: CpuKernels | None = None,
) -> AttentionBackend:
    module_name, class_name = _BACKENDS[name].split(":")
    factory: Callable[..., AttentionBackend] = getattr(
        importlib.import_module(module_name), class_name
    )
    if name in _NEEDS_CPU_KERNELS:
        return factory(req_to_token_pool, kv_pool, cpu_kernels)
    return factory(req_to_token_pool, kv_pool)
