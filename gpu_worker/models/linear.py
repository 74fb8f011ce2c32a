"""Linear: nn.Linear that multiplies a few rows with the CPU kernel when one is attached.

Decoding computes one row per request, and for a few rows a matmul is a pass over the
weight: oneDNN's bf16 GEMV read it at 8-13 GB/s on a host that streams 28 GB/s, the
kernel at about 25 (gpu_worker/kernels/cpu_kernels.c). Past MAX_SMALL_M rows the product
is compute-bound and oneDNN's GEMM is the better one. It stays an nn.Linear, so forward
hooks, state dicts and weight loading see the module they expect.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels.cpu_kernels import MAX_SMALL_M, CpuKernels

PACKING_ROWS_HINT = 64


class Linear(nn.Linear):
    # Attached by the ModelRunner (attach_cpu_kernels) when the model serves on CPU.
    cpu_kernels: CpuKernels | None = None
    # The weight in oneDNN's blocked layout, for bfloat16 products of many rows: oneDNN
    # reorders a plain weight on every call otherwise (M=64 decode: 42 against 50 ms a step).
    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if kernels is not None and x.dim() == 2:
            if x.shape[0] <= MAX_SMALL_M:
                return kernels.linear(x, self.weight, self.bias)
            if self.packed_weight is not None and x.dtype == self.weight.dtype:
                return torch.ops.mkldnn._linear_pointwise(
                    x, self.packed_weight, self.bias, "none", [], ""
                )
        return F.linear(x, self.weight, self.bias)


def attach_cpu_kernels(model: nn.Module, kernels: CpuKernels | None) -> int:
    """Give every Linear of `model` the kernels (None detaches), and pack bfloat16 weights
    for oneDNN; returns how many Linears there are."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.cpu_kernels = kernels
            module.packed_weight = None
            if kernels is not None and module.weight.dtype == torch.bfloat16:
                # The batch-size hint only picks a blocking; any row count works.
                module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                    module.weight.detach(), PACKING_ROWS_HINT
                )
            count += 1
    return count
