"""EngineConfig: every engine option in one validated dataclass, passed whole."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from runtime.model_files import DEFAULT_MODEL

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
SCHEDULE_POLICIES = ("spf", "fcfs", "lpm")
SPECULATIVE_METHODS = ("ngram", "draft")
# When drafts are verified: "when_it_pays" (the step costs measured here say a verify step
# yields more tokens per second than a decode step), or "always".
SPECULATIVE_VERIFY = ("when_it_pays", "always")


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    # "auto": bfloat16, the dtype these models are served in, except on a CPU without native
    # bfloat16 matmuls (no AVX512-BF16 or AMX), where bfloat16 prefill runs ~80x slower than
    # float32 and float32 is served instead. "float32" for exact comparisons.
    dtype: str = "auto"
    # "auto": cpu_kernel on CPU when the CPU kernels are built; on CUDA flashinfer where it
    # is installed (served only if it passes the start-up self-check); else torch_native.
    attention_backend: str = "auto"
    # On CPU, attention, few-row matmuls and some elementwise ops run in C kernels built with
    # the system compiler (gpu_worker/kernels); False keeps every op on PyTorch's own kernels.
    cpu_kernels: bool = True
    # KV slots per page; the prefix cache matches and evicts whole pages.
    page_size: int = 1
    max_running_requests: int = 256
    # Token budget of one extend forward; longer prompts are prefilled in chunks. Prompts
    # finish at chunk ends and running streams wait out each chunk, so smaller chunks give
    # earlier first tokens and shorter stalls; through `up` on CPU, mixed-64's TTFT p50 was
    # 7.1 s at 2048 against 8.3 s at 4096 for 3% less throughput (benchmarks/NOTES.md).
    chunked_prefill_size: int = 2048
    # KV pool size in tokens. When None: sized from kv_cache_memory_gb on CPU, or on CUDA
    # from the memory free after the weights, keeping 1 - mem_fraction_static of the device
    # (or more, if the largest forward needs more) as headroom (memory/gpu_memory.py).
    max_total_tokens: int | None = None
    kv_cache_memory_gb: float = 2.0
    mem_fraction_static: float = 0.85
    # CUDA: decode through captured CUDA graphs (model_executor/graph_runner.py) where the
    # attention backend supports capture (flashinfer); off with forward hooks.
    cuda_graphs: bool = True
    # Longest prompt + output accepted; None means the model's max_position_embeddings.
    context_length: int | None = None
    disable_radix_cache: bool = False
    # spf: shortest prefill first, aged (scheduling/policy.py); fcfs; lpm.
    schedule_policy: str = "spf"
    forward_hooks: list[dict[str, Any]] = field(default_factory=list)
    # Seeds the random weights of `random:` models and the sampling of unseeded requests.
    seed: int = 0
    # Speculative decoding: None (off), "ngram" (drafts looked up in the request's own
    # prompt and output) or "draft" (drafts sampled from draft_model, a smaller model with
    # the same tokenizer), verifying up to num_draft_tokens drafts per request per step.
    speculative: str | None = None
    num_draft_tokens: int = 4
    draft_model: str | None = None
    speculative_verify: str = "when_it_pays"
    # Tensor parallelism: the model split over this many ranks (processes) of one worker,
    # Megatron-style; rank 0 schedules and samples (gpu_worker/parallel, docs/TENSOR_PARALLEL.md).
    tp: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as error:
                raise ValueError(f"device {self.device!r} is not a torch device") from error
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {['auto', *DTYPES]}")
        _require_positive_int("page_size", self.page_size)
        _require_positive_int("max_running_requests", self.max_running_requests)
        _require_positive_int("chunked_prefill_size", self.chunked_prefill_size)
        if self.max_total_tokens is not None:
            _require_positive_int("max_total_tokens", self.max_total_tokens)
        if self.context_length is not None:
            _require_positive_int("context_length", self.context_length)
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy {self.schedule_policy!r} is not one of {list(SCHEDULE_POLICIES)}"
            )
        if not isinstance(self.forward_hooks, list):
            raise ValueError("forward_hooks must be a list of hook specs")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative {self.speculative!r} is not one of {[None, *SPECULATIVE_METHODS]}"
            )
        _require_positive_int("num_draft_tokens", self.num_draft_tokens)
        _require_positive_int("tp", self.tp)
        if self.speculative_verify not in SPECULATIVE_VERIFY:
            raise ValueError(
                f"speculative_verify {self.speculative_verify!r} is not one of "
                f"{list(SPECULATIVE_VERIFY)}"
            )
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError(
                "draft_model names the draft model of speculative='draft', and only of it"
            )
        for name in ("cpu_kernels", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @classmethod
    def from_kwargs(cls, model: str, **options: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: {sorted(known)}")
        return cls(model=model, **options)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch build or machine has no CUDA")
        return device

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device().type == "cpu" and not cpu_has_native_bfloat16():
            return torch.float32
        return torch.bfloat16

    def dtype_name(self) -> str:
        """The resolved dtype's name, e.g. "float32" for "auto" on a CPU without bf16."""
        return str(self.torch_dtype()).removeprefix("torch.")


def cpu_has_native_bfloat16() -> bool:
    """Whether oneDNN runs bfloat16 matmuls in hardware on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bfloat16 matmuls run on them)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _require_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
