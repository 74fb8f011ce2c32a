"""Layers with a CPU-kernel path: Linear and RMSNorm, and attach_cpu_kernels to enable it.

They stay nn.Modules of the usual kind, so forward hooks, state dicts and weight loading
see what they expect; the ModelRunner attaches the kernels (gpu_worker/kernels) on CPU.

- Linear: decoding computes one row per request, and for a few rows a matmul is a pass
  over the weight: oneDNN's bf16 GEMV on a plain weight read it at 8-13 GB/s on a host that
  streams 28 GB/s, the kernel at about 25. gemm_bf16, on a copy of the weights packed once
  for it, takes every bfloat16 row count where the CPU has AVX512-BF16, except the 3 rows
  and more that oneDNN multiplies on AMX tiles where the CPU has those.
  In float32 on a CPU without AVX-512, oneDNN takes the products of more rows than that
  kernel does on a packed copy.
- RMSNorm: eight elementwise torch ops, each a pass over the rows, become one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.config import cpu_has_amx, cpu_has_native_bfloat16
from gpu_worker.kernels.cpu_kernels import MAX_SMALL_M, CpuKernels

PACKING_ROWS_HINT = 64
# On packed bfloat16 weights oneDNN streams the weight as fast for 3-8 rows as for one
# (30 SmolLM2 layers: 10-12 ms at 3-8 rows), while a row-at-a-time kernel's cost grows with
# the rows (8.7 ms at 1, 12 at 2, 15 at 3): below this many rows a kernel takes the product
# where oneDNN holds a packed copy (gemm_bf16, else the few-row kernel), and the few-row
# kernel up to MAX_SMALL_M in float32 (no packed weight; MKL's sgemm took 2x its time at 8).
PACKED_GEMM_FROM_ROWS = 3
# Without AVX-512 (an AVX2-only AMD EPYC, 2 threads, 30 SmolLM2 layers' float32 weights) the
# few-row kernel in ymm registers took 22-43 ms at 1-8 rows, oneDNN on packed weights 35-49
# and MKL's sgemm 48-97; at 64 and 2048 rows oneDNN packed led MKL by 1.25x and 1.12x
# (benchmarks/NOTES.md, 2026-11-28 (tenth session)). gemm_f32 (gpu_worker/kernels/gemm_f32.c)
# then led oneDNN packed at every row count, 1.08-1.5x from 8 to 2048 rows (bench_gemm.py
# --dtype float32, 2026-11-29), and a mixed-64 prefill on it took 29.3 s against 30.8 with
# oneDNN from 128 rows: float32 products there all take gemm_f32, with no oneDNN copy, and
# oneDNN's packed copy only a shape gemm_f32 does not take (columns not a multiple of 16).


def hooked(*modules: nn.Module) -> bool:
    """Whether a forward hook or pre-hook of any of these modules may see, and keep, the
    tensors they take or return (so a caller must not write over those)."""
    return any(module._forward_hooks or module._forward_pre_hooks for module in modules)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: float32 statistics, cast back before the weight multiply."""

    cpu_kernels: CpuKernels | None = None

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if kernels is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            return kernels.rms_norm(x, self.weight, self.eps)
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast before the weight multiply, as transformers does, so bf16 rounding matches.
        return self.weight * x.to(input_dtype)

    def add_then_norm(
        self, x: torch.Tensor, residual: torch.Tensor, overwrite: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, this norm of it): one kernel pass on CPU, where the add on torch
        wrote a sum only for the norm to read it again. `overwrite`: x and residual are the
        caller's own intermediates, which nothing reads afterwards, so the kernel may write
        the sum over residual and the norm over x. A hook on this norm keeps the two calls,
        so it sees the module called as before."""
        kernels = self.cpu_kernels
        if kernels is not None and x.dim() == 2 and x.dtype == residual.dtype == self.weight.dtype:
            if not hooked(self):
                return kernels.add_rms_norm(x, residual, self.weight, self.eps, overwrite)
        total = residual + x
        return total, self(total)


class Linear(nn.Linear):
    # Attached by the ModelRunner (attach_cpu_kernels) when the model serves on CPU.
    cpu_kernels: CpuKernels | None = None
    # The weight in oneDNN's blocked layout, for bfloat16 products of many rows: oneDNN
    # reorders a plain weight on every call otherwise (M=64 decode: 42 against 50 ms a step).
    # A copy made at attach time: it doubles the bf16 weights' memory, and weights changed
    # afterwards need attach_cpu_kernels again.
    packed_weight: torch.Tensor | None = None
    # The weight in gemm_bf16's layout (gpu_worker/kernels/gemm_bf16.c), where that kernel
    # takes it. Without AMX it computes every bfloat16 product, of any row count, in place
    # of oneDNN (1.2-1.55x its rate at 8-64 rows) and of linear_small_m (1.13x at one row,
    # 1.7x at two: 30 SmolLM2 layers from DRAM in 7.4 and 7.1 ms against 8.4 and 12.1, in
    # benchmarks/bench_gemm.py), and no oneDNN copy is kept. Where the CPU has AMX tiles
    # oneDNN multiplies on those and keeps its packed copy for 3 rows and more (a Xeon's two
    # cores: 11.6 ms at 4 rows against gemm_bf16's 16.1, 4.7x at 64), and gemm_bf16 takes
    # one and two rows (17.1 and 15.7 ms against the few-row kernel's 21.3 and 17.9 and
    # oneDNN's 22.9 and 15.8): a third copy of the weights there, for one request decoding
    # 1.14x faster in the engine (benchmarks/NOTES.md, 2026-11-27 (late)). float32 weights
    # in gemm_f32's layout where the CPU lacks AVX-512: it takes every row count there.
    gemm_weight: torch.Tensor | None = None
    # Fewer rows than this go to a kernel (gemm_bf16 or the few-row one) where packed_weight
    # is set: PACKED_GEMM_FROM_ROWS for bfloat16, MAX_SMALL_M + 1 for float32.
    packed_from_rows: int = PACKED_GEMM_FROM_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias, by the fastest path for x's rows (a row-parallel Linear
        passes no bias: it adds its own once, after the all-reduce)."""
        kernels = self.cpu_kernels
        if kernels is not None and x.dim() == 2:
            packed = self.packed_weight is not None and x.dtype == self.weight.dtype
            rows = x.shape[0]
            if (
                self.gemm_weight is not None
                and x.dtype == self.weight.dtype
                and rows > 0  # the kernels take one row and more
                and (not packed or rows < self.packed_from_rows)
            ):
                return kernels.gemm(x, self.gemm_weight, bias)
            if 0 < rows < (self.packed_from_rows if packed else MAX_SMALL_M + 1):
                return kernels.linear(x, self.weight, bias)
            if packed and rows:
                return torch.ops.mkldnn._linear_pointwise(
                    x, self.packed_weight, bias, "none", [], ""
                )
        return F.linear(x, self.weight, bias)


def attach_cpu_kernels(model: nn.Module, kernels: CpuKernels | None) -> None:
    """Give every module of `model` that has a kernel path (a `cpu_kernels` attribute) the
    kernels (None detaches), and pack Linears' bfloat16 weights for gemm_bf16, and for
    oneDNN where gemm_bf16 does not take them or the CPU has AMX tiles (Linear.gemm_weight
    says which rows each takes); float32 weights for gemm_f32 where the CPU lacks AVX-512
    (for oneDNN where gemm_f32 does not take the shape)."""
    onednn_too = cpu_has_amx()  # oneDNN multiplies on the tiles from PACKED_GEMM_FROM_ROWS
    for module in model.modules():
        if hasattr(module, "fused_layers"):
            module.fused_layers = None  # it points at the weights packed before
        if not hasattr(module, "cpu_kernels"):
            continue
        module.cpu_kernels = kernels
        if isinstance(module, Linear):
            module.packed_weight = module.gemm_weight = None
            module.packed_from_rows = PACKED_GEMM_FROM_ROWS
            if (
                kernels is not None
                and module.weight.dtype == torch.float32
                and not kernels.avx512  # MKL's sgemm led by oneDNN there
            ):
                module.gemm_weight = kernels.pack_gemm_weight(module.weight)
                if module.gemm_weight is None:  # the few-row kernel, then oneDNN
                    module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                        module.weight.detach(), PACKING_ROWS_HINT
                    )
                    module.packed_from_rows = MAX_SMALL_M + 1
                continue
            if kernels is not None and module.weight.dtype == torch.bfloat16:
                module.gemm_weight = kernels.pack_gemm_weight(module.weight)
                if module.gemm_weight is not None and not onednn_too:
                    continue
            if (
                kernels is not None
                and module.weight.dtype == torch.bfloat16
                and cpu_has_native_bfloat16()  # oneDNN refuses to pack bf16 elsewhere
            ):
                # The batch-size hint only picks a blocking; any row count works.
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                    module.weight.detach(), PACKING_ROWS_HINT
                )


def repack_cpu_weights(model: nn.Module) -> None:
    """attach_cpu_kernels again with the kernels `model` has: after its weights changed in
    place, the packed copies the products read are packed anew (a no-op without kernels)."""
    attached = (getattr(module, "cpu_kernels", None) for module in model.modules())
    kernels = next((k for k in attached if k is not None), None)
    if kernels is not None:
        attach_cpu_kernels(model, kernels)
