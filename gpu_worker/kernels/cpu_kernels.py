"""The CPU kernels (attention.c, extend_attention.c with its bfloat16 and AMX halves
extend_attention_bf16.h and extend_attention_amx.h, gemm_bf16.c, gemm_f32.c, layers.c,
activation.c, sampling.c, decoder_layers.c and common.h beside this file): built once per
machine into one library (kernel_build.py), cached, and called through ctypes with the
tensors' data pointers.
Where it runs extend attention on AMX tiles, amx_check.py checks them against the
AVX512-BF16 path once loaded.

Why C and ctypes rather than a torch C++ extension: the files need no torch headers, so it
compiles in about a second where an extension takes a minute on two cores; and it is built
with -march=native, so it uses whatever vector units this CPU has. The built library is
cached under the streamserve cache folder, keyed by the source, the compiler command and the
CPU's flags. Where no compiler is found, `load()` returns None, the engine serves with
PyTorch's own ops, and one warning says so (STREAMSERVE_CPU_KERNELS=0 also turns them off).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from functools import cache
from typing import Any

import torch

from gpu_worker.kernels.kernel_build import build_library, find_compiler

logger = logging.getLogger(__name__)

# linear_small_m handles at most this many rows (MAX_SMALL_M in layers.c).
MAX_SMALL_M = 8
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


def _entry(library: ctypes.CDLL, name: str, *argtypes: Any, optional: bool = False) -> Any:
    """The library's function `name` taking `argtypes` and returning a C int (every kernel
    returns its status); None for an `optional` one the library lacks."""
    function = getattr(library, name, None)
    if function is None:
        if optional:
            return None
        raise AttributeError(f"the CPU kernels library has no {name}")
    function.restype = _int
    function.argtypes = list(argtypes)
    return function


class CpuKernels:
    """The loaded library with typed entry points."""

    def __init__(self, library: ctypes.CDLL) -> None:
        # Built with -march=native: without AVX-512 the bfloat16 silu_and_mul refuses, and
        # without AVX-512 or AVX2 with FMA the extend attention and the float32 silu_and_mul;
        # their callers keep torch's.
        features = library.kernel_features()
        self.avx512, self.avx512_bf16 = bool(features & 1), bool(features & 2)
        self.vector_extend = bool(features & 4)
        self._attention = _entry(library, "paged_decode_attention",
            _ptr, _int, _i64, _ptr, _ptr, _int, _i64, _i64, _ptr, _i64, _ptr, _ptr,
            _i64, _i64, _i64, _i64, _f32, _i64, _ptr, _int,
        )  # fmt: skip
        self._extend = _entry(library, "extend_attention",
            _ptr, _int, _i64, _ptr, _ptr, _int, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr,
            _i64, _i64, _i64, _i64, _f32, _ptr, _int,
        )  # fmt: skip
        # None from libraries of revisions before them (bench_extend_attention loads those).
        self._amx = _entry(library, "extend_attention_amx", _int, optional=True)
        # dtype -> (gemm, pack, supported): gemm_bf16.c's and gemm_f32.c's, where present.
        self._gemms: dict[torch.dtype, tuple[Any, Any, Any]] = {}
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            args = (_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr)
            if (gemm := _entry(library, f"gemm_{name}", *args, optional=True)) is not None:
                pack = _entry(library, f"gemm_{name}_pack", _ptr, _i64, _i64, _ptr)
                supported = _entry(library, f"gemm_{name}_supported", _i64, _i64)
                self._gemms[dtype] = (gemm, pack, supported)
        # gemm_f32 with SiLU·mul in its epilogue (the MLP's gate_up product), where built.
        self._gemm_silu_mul = _entry(library, "gemm_f32_silu_mul", *args, optional=True)
        self._linear = _entry(library, "linear_small_m",
            _ptr, _int, _i64, _i64, _ptr, _int, _i64, _ptr, _int, _ptr, _int,
        )  # fmt: skip
        self._write_kv = _entry(library, "write_kv",
            _ptr, _ptr, _int, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _int, _i64, _i64,
        )  # fmt: skip
        self._rms_norm = _entry(library, "rms_norm", _ptr, _ptr, _ptr, _int, _i64, _i64, _f32)
        self._add_rms_norm = _entry(library, "add_rms_norm",
            _ptr, _ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _f32,
        )  # fmt: skip
        self._silu_and_mul = _entry(library, "silu_and_mul", _ptr, _i64, _ptr, _int, _i64, _i64)
        self._rotary = _entry(library, "rotary_inplace",
            _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64,
        )  # fmt: skip
        # Every decoder layer in one call (decoder_layers.c; gpu_worker/models/fused_layers.py).
        self.decoder_layers = _entry(library, "decoder_layers", _ptr, _ptr, optional=True)
        self._argmax = _entry(library, "argmax_rows", _ptr, _i64, _i64, _i64, _ptr)
        self._bitmask = _entry(library, "apply_token_bitmask",
            _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64,
        )  # fmt: skip

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [bs, num_heads, head_dim]; rows may be strided
        k_cache: torch.Tensor,  # [kv_heads, slots, head_dim] (any strides, head_dim dense)
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,  # [rows, width] int64
        req_pool_indices: torch.Tensor,  # [bs] int64
        seq_lens: torch.Tensor,  # [bs] int64, on cpu
        scale: float,
        chunk: int,
        out: torch.Tensor,  # [bs, num_heads, head_dim] contiguous
    ) -> torch.Tensor:
        bs, num_heads, head_dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous()
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
        assert req_to_token.stride(1) == 1
        status = self._attention(
            q.data_ptr(), _DTYPE_CODES[q.dtype], q.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
            k_cache.stride(0), k_cache.stride(1),
            req_to_token.data_ptr(), req_to_token.stride(0),
            req_pool_indices.data_ptr(), seq_lens.data_ptr(),
            bs, num_heads, k_cache.shape[0], head_dim, scale, chunk,
            out.data_ptr(), _DTYPE_CODES[out.dtype],
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"paged_decode_attention failed with status {status}")
        return out

    def extend_attention(
        self,
        q: torch.Tensor,  # [tokens, num_heads, head_dim]; tokens may be strided
        k_cache: torch.Tensor,  # [kv_heads, slots, head_dim] (any strides, head_dim dense)
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,  # [rows, width] int64
        req_pool_indices: torch.Tensor,  # [bs] int64
        prefix_lens: torch.Tensor,  # [bs] int64, on cpu: keys cached before the new tokens
        extend_lens: torch.Tensor,  # [bs] int64, on cpu: new tokens, consecutive in q
        scale: float,
        out: torch.Tensor,  # [tokens, num_heads, head_dim] contiguous
    ) -> bool:
        """Causal attention of each request's new tokens over its prefix and themselves, with
        every key and value read from the pool (the new ones already written). False where
        the kernel does not handle the shape (head_dim not a multiple of 16, or more than 8
        query heads per kv head) or the CPU (neither AVX-512 nor AVX2 with FMA): the caller
        attends another way."""
        tokens, num_heads, head_dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous()
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
        assert req_to_token.stride(1) == 1 and prefix_lens.is_contiguous()
        status = self._extend(
            q.data_ptr(), _DTYPE_CODES[q.dtype], q.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
            k_cache.stride(0), k_cache.stride(1),
            req_to_token.data_ptr(), req_to_token.stride(0),
            req_pool_indices.data_ptr(), prefix_lens.data_ptr(), extend_lens.data_ptr(),
            len(extend_lens), num_heads, k_cache.shape[0], head_dim, scale,
            out.data_ptr(), _DTYPE_CODES[out.dtype],
        )  # fmt: skip
        if status == -1:
            return False
        if status != 0:
            raise RuntimeError(f"extend_attention failed with status {status}")
        return True

    def use_amx(self, enable: bool) -> bool:
        """Whether bfloat16 extend attention may run on AMX tiles; returns whether it now
        does (the CPU has AMX, the library was built for it and Linux granted the tiles)."""
        return self._amx is not None and bool(self._amx(int(enable)))

    def write_kv(
        self,
        k: torch.Tensor,  # [tokens, kv_heads * head_dim], rows may be strided
        v: torch.Tensor,
        loc: torch.Tensor,  # [tokens] int64 slots
        k_cache: torch.Tensor,  # [kv_heads, slots, head_dim], head_dim dense
        v_cache: torch.Tensor,
    ) -> None:
        """Store each token's K and V rows at its slot, cast to the pool's dtype."""
        kv_heads, _, head_dim = k_cache.shape
        assert k.dtype == v.dtype and k.stride(1) == 1 and v.stride(1) == 1
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
        assert loc.dtype == torch.int64 and loc.is_contiguous()
        self._write_kv(
            k.data_ptr(), v.data_ptr(), _DTYPE_CODES[k.dtype], k.stride(0), v.stride(0),
            loc.data_ptr(), k.shape[0], kv_heads, head_dim,
            k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
            k_cache.stride(0), k_cache.stride(1),
        )  # fmt: skip

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] (M <= MAX_SMALL_M) @ weight[N, K]^T + bias, in x's dtype."""
        x = x.contiguous()
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
        status = self._linear(
            x.data_ptr(), _DTYPE_CODES[x.dtype], x.shape[0], x.shape[1],
            weight.data_ptr(), _DTYPE_CODES[weight.dtype], weight.shape[0],
            None if bias is None else bias.data_ptr(),
            0 if bias is None else _DTYPE_CODES[bias.dtype],
            out.data_ptr(), _DTYPE_CODES[out.dtype],
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"linear_small_m failed with status {status}")
        return out

    def pack_gemm_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight` [N, K] in its gemm's layout (gemm_bf16.c for bfloat16, gemm_f32.c for
        float32), or None where that kernel does not take its shape or this CPU (gemm_bf16
        needs AVX512-BF16; gemm_f32 is built only where AVX2 and FMA lack AVX-512)."""
        n, k = weight.shape
        gemm = self._gemms.get(weight.dtype)
        if gemm is None or not gemm[2](n, k):
            return None
        weight = weight.detach().contiguous()
        packed = torch.empty_like(weight)
        if gemm[1](weight.data_ptr(), n, k, packed.data_ptr()) != 0:
            return None
        return packed

    def gemm(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] @ W^T + bias, W packed by `pack_gemm_weight` (packed's shape and dtype)."""
        x = x.contiguous()
        n, k = packed.shape
        assert x.dtype == packed.dtype and x.shape[1] == k
        assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        status = self._gemms[x.dtype][0](
            x.data_ptr(), x.shape[0], k, packed.data_ptr(), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"gemm failed with status {status}")
        return out

    def gemm_silu_mul(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """silu(gate) * up of [gate | up] = x @ W^T + bias in one pass (gemm_f32.c), bit for
        bit `silu_and_mul(gemm(x, packed, bias))`; None where those two must run instead:
        not float32 on gemm_f32, or a shape the fused kernel does not take."""
        if x.dtype != torch.float32 or self._gemm_silu_mul is None or packed.dtype != x.dtype:
            return None
        x = x.contiguous()
        n, k = packed.shape
        assert x.shape[1] == k and (bias is None or bias.is_contiguous())
        out = torch.empty((x.shape[0], n // 2), dtype=x.dtype)
        status = self._gemm_silu_mul(
            x.data_ptr(), x.shape[0], k, packed.data_ptr(), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out if status == 0 else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' LlamaRMSNorm of x [rows, hidden] (x and weight of one dtype)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype],
            x.shape[0], x.shape[1], eps,
        )  # fmt: skip
        return out

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        overwrite: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, RMSNorm of that sum) in one pass (x, residual [rows, hidden] and
        weight of one dtype; the sum rounded as torch's add): new tensors, or with
        `overwrite` the sum in residual's memory and the norm in x's."""
        x, residual = x.contiguous(), residual.contiguous()
        if overwrite:
            # Memory the pass has just read is in cache; two fresh prefill-size outputs
            # were not, and writing them took a prefill's norms 0.3-0.6 s some rounds
            # against 0.10-0.14 in place (mixed-64, bench_prefill_profile.py).
            total, out = residual, x
        else:
            total, out = torch.empty_like(x), torch.empty_like(x)
        self._add_rms_norm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), total.data_ptr(),
            out.data_ptr(), _DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], eps,
        )  # fmt: skip
        return total, out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of x [rows, 2 * inter] = [gate | up] (rows may be strided), rounded
        as torch's two ops round (activation.c); None where the kernel leaves it to torch:
        bfloat16 without AVX-512, float32 without AVX2 and FMA, other dtypes."""
        if not (x.dtype == torch.bfloat16 and self.avx512) and not (
            x.dtype == torch.float32 and self.vector_extend
        ):
            return None  # before allocating: this runs on every MLP
        rows, width = x.shape
        assert x.stride(1) == 1 and width % 2 == 0
        out = torch.empty(rows, width // 2, dtype=x.dtype)
        status = self._silu_and_mul(
            x.data_ptr(), x.stride(0), out.data_ptr(), _DTYPE_CODES[x.dtype], rows, width // 2
        )
        return out if status == 0 else None

    def rotary_inplace(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Neox rotary on x [tokens, heads, head_dim] (rows may be strided; heads and
        head_dim dense), cos and sin [tokens, head_dim] contiguous, all of one dtype."""
        tokens, heads, head_dim = x.shape
        assert x.stride(2) == 1 and x.stride(1) == head_dim and cos.is_contiguous()
        assert sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype
        self._rotary(
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), _DTYPE_CODES[x.dtype],
            tokens, heads, head_dim, x.stride(0),
        )  # fmt: skip

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of float32 rows x [rows, cols] (rows may be strided)."""
        rows, cols = x.shape
        assert x.dtype == torch.float32 and x.stride(1) == 1 and cols > 0
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr())
        return out

    def apply_token_bitmask(self, x: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
        """Set x[rows[i], t] to -inf where bit t of mask[i] is clear (x float32 [bs, cols],
        rows int64 [n], mask int32 [n, ceil(cols / 32)]), in place."""
        assert x.dtype == torch.float32 and x.stride(1) == 1
        assert rows.dtype == torch.int64 and mask.dtype == torch.int32 and mask.is_contiguous()
        rows = rows.contiguous()
        self._bitmask(x.data_ptr(), x.stride(0), x.shape[1], rows.data_ptr(), mask.data_ptr(),
                      mask.shape[0], mask.shape[1])  # fmt: skip


@cache
def load() -> CpuKernels | None:
    """The kernels, built on first use; None (with one warning) where they cannot be."""
    if os.environ.get("STREAMSERVE_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels off (STREAMSERVE_CPU_KERNELS=0): serving with torch ops")
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning(
            "no C compiler found (set CC or install gcc): decode runs on PyTorch's generic "
            "ops, about 2x slower on CPU"
        )
        return None
    try:
        kernels = CpuKernels(ctypes.CDLL(str(build_library(compiler))))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("could not build the CPU kernels (%s): serving with torch ops", detail)
        return None
    from gpu_worker.kernels.amx_check import check_amx

    check_amx(kernels)
    return kernels
