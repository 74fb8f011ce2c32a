"""The start-up check of extend attention on AMX tiles (extend_attention_amx.h).

Where the kernels' library runs bfloat16 extend attention on AMX, one small chunk is attended
with the tiles and without them (the AVX512-BF16 path) before the worker serves; if the two
disagree, the tiles are turned off and an error line says so. Why: no host this project's
suite runs on has AMX. The suite checks the AMX path's indexing with tiles emulated in C
(STREAMSERVE_EMULATE_AMX); this checks the instructions themselves, where they run, the way
the GPU worker checks its fast path against eager torch at start-up.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

# Outputs are bfloat16 of values below ~1: both paths round to within a unit or two in the
# last place (2^-8 near 1); a misplaced tile reads other keys and is off by tenths.
TOLERANCE = 0.03


class CpuKernels(Protocol):
    """What the check uses of cpu_kernels.CpuKernels (which calls it: no import back)."""

    def use_amx(self, enable: bool) -> bool: ...

    def extend_attention(self, *args: object) -> bool: ...


def check_amx(kernels: CpuKernels) -> bool:
    """Whether extend attention now runs on AMX tiles: False where the library or the CPU
    has none, or where the tiles disagreed with the AVX512-BF16 path (then turned off)."""
    if not kernels.use_amx(True):
        return False
    chunk = _small_chunk()
    with_tiles = _attend(kernels, chunk)
    kernels.use_amx(False)
    without = _attend(kernels, chunk)
    if with_tiles is None or without is None:
        return False  # a shape the kernel refuses: nothing runs on tiles
    apart = (with_tiles.float() - without.float()).abs().max().item()
    if apart > TOLERANCE:
        logger.error(
            "extend attention on AMX tiles disagrees with the AVX512-BF16 path (max %.3g "
            "apart): serving without AMX",
            apart,
        )
        return False
    kernels.use_amx(True)
    logger.info("extend attention runs on AMX tiles (checked against AVX512-BF16)")
    return True


def _small_chunk() -> tuple:
    """extend_attention's arguments (less `out`) for three requests, two continuing a
    prefix, lengths off the tiles' 16 queries and 32 keys, three query heads per kv head."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, heads, head_dim, slots = 2, 6, 64, 256
    prefix_lens = torch.tensor([0, 20, 50])
    extend_lens = torch.tensor([37, 16, 3])
    k_cache = torch.randn(kv_heads, slots, head_dim, generator=generator).bfloat16()
    v_cache = torch.randn(kv_heads, slots, head_dim, generator=generator).bfloat16()
    table = torch.randperm(slots, generator=generator)[: 3 * 64].view(3, 64)
    q = torch.randn(int(extend_lens.sum()), heads, head_dim, generator=generator).bfloat16()
    return q, k_cache, v_cache, table, torch.arange(3), prefix_lens, extend_lens, 0.125


def _attend(kernels: CpuKernels, chunk: tuple) -> torch.Tensor | None:
    out = torch.empty(chunk[0].shape, dtype=torch.bfloat16)
    return out if kernels.extend_attention(*chunk, out) else None
