"""Extend attention on AMX tiles (kernels/extend_attention_amx.h), checked on any CPU with
AVX512-BF16: the library built with STREAMSERVE_EMULATE_AMX runs the AMX path's own code with
each tile instruction done in C, so its layouts, tiles and masks meet the float64 reference
here; the real instructions are checked at start-up where they run (amx_check.py)."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

from gpu_worker.kernels import cpu_kernels, kernel_build
from gpu_worker.kernels.amx_check import check_amx
from tests.extend_chunks import EXTEND_SHAPES, extend_case, reference_extend


def _emulated(tmp_path_factory, *defines: str) -> cpu_kernels.CpuKernels:
    native = cpu_kernels.load()
    if native is None or not native.avx512_bf16:
        pytest.skip("the emulated AMX path runs on the AVX512-BF16 kernels: this CPU has none")
    target = tmp_path_factory.mktemp("amx") / "emulated.so"
    compiler = kernel_build.find_compiler()
    kernel_build.compile_library(compiler, target, defines=["STREAMSERVE_EMULATE_AMX", *defines])
    return cpu_kernels.CpuKernels(ctypes.CDLL(str(target)))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return _emulated(tmp_path_factory)


@pytest.mark.parametrize("head_dim,heads,kv_heads", EXTEND_SHAPES)
def test_amx_path_matches_reference_and_the_avx512_path(emulated, head_dim, heads, kv_heads):
    args = extend_case(torch.bfloat16, head_dim, heads, kv_heads)
    assert emulated.use_amx(True)
    tiles = torch.empty(args[0].shape, dtype=torch.bfloat16)
    handled = emulated.extend_attention(*args, tiles)
    assert handled == (heads // kv_heads <= 8)
    if not handled:
        return  # the torch path's shapes
    emulated.use_amx(False)
    vectors = torch.empty_like(tiles)
    assert emulated.extend_attention(*args, vectors)
    emulated.use_amx(True)
    expected = reference_extend(*args)
    torch.testing.assert_close(tiles.double(), expected, rtol=1e-2, atol=1e-2)
    # The same products summed in another order: a rounding apart here and there, at most a
    # bfloat16 unit in the last place of an output below 1 (2^-8), or of the output itself
    # above (they reach ~4), and as close to float64 on average as the vector path.
    larger = torch.maximum(tiles.double().abs(), vectors.double().abs()).clamp_min(2**-126)
    unit = torch.exp2(torch.floor(torch.log2(larger)) - 7).clamp_min(2**-8)
    assert ((tiles.double() - vectors.double()).abs() <= unit).all()
    error_tiles = (tiles.double() - expected).abs().mean().item()
    error_vectors = (vectors.double() - expected).abs().mean().item()
    assert error_tiles <= error_vectors * 1.01


def test_float32_never_runs_on_tiles(emulated):
    args = extend_case(torch.float32, 64, 9, 3)
    emulated.use_amx(True)
    out = torch.empty(args[0].shape)
    assert emulated.extend_attention(*args, out)
    torch.testing.assert_close(out.double(), reference_extend(*args), rtol=1e-5, atol=1e-5)


def test_start_up_check_keeps_tiles_that_agree(emulated, caplog):
    with caplog.at_level(logging.INFO, logger="gpu_worker.kernels.amx_check"):
        assert check_amx(emulated)
    assert "runs on AMX tiles" in caplog.text
    assert emulated.use_amx(True)


def test_start_up_check_turns_off_tiles_that_disagree(tmp_path_factory, caplog):
    faulty = _emulated(tmp_path_factory, "STREAMSERVE_EMULATE_AMX_FAULT")
    with caplog.at_level(logging.INFO, logger="gpu_worker.kernels.amx_check"):
        assert not check_amx(faulty)
    assert "disagrees" in caplog.text and "serving without AMX" in caplog.text
    # Off: the same chunk now attends on the AVX512-BF16 path and is right.
    args = extend_case(torch.bfloat16, 64, 9, 3)
    out = torch.empty(args[0].shape, dtype=torch.bfloat16)
    assert faulty.extend_attention(*args, out)
    torch.testing.assert_close(out.double(), reference_extend(*args), rtol=1e-2, atol=1e-2)


def test_a_library_without_amx_says_so():
    native = cpu_kernels.load()
    if native is None:
        pytest.skip("no C compiler")
    # This suite's hosts have no AMX; where one does, the library uses it once checked.
    has_amx = "amx_bf16" in open("/proc/cpuinfo").read()
    assert native.use_amx(True) == has_amx
    assert check_amx(native) == has_amx
