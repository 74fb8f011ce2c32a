"""The bfloat16 matmul kernel (gpu_worker/kernels/gemm_bf16.c): against a float64 reference,
the shapes it leaves to oneDNN, which rows of a Linear it computes, and an engine on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import cpu_kernels
from gpu_worker.models import layers
from gpu_worker.models.layers import PACKED_GEMM_FROM_ROWS, Linear, attach_cpu_kernels
from tests.gemm_engines import greedy_with_and_without_gemm


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_kernels.load()
    assert loaded is not None, "the test machine has a C compiler: the kernels must build"
    if not loaded.avx512_bf16:
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 products stay on oneDNN")
    # Where the CPU has it, packing must work: a broken one would skip every test here.
    assert loaded.pack_gemm_weight(torch.zeros(64, 2, dtype=torch.bfloat16)) is not None
    return loaded


@pytest.mark.parametrize("rows", [*range(1, 14), 64])  # every tail of the 6-row micro-tile
@pytest.mark.parametrize("out_features,in_features", [(64, 2), (192, 100), (128, 1536)])
def test_gemm_matches_float64_reference(kernels, rows, out_features, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    packed = kernels.pack_gemm_weight(weight)
    expected = F.linear(x.double(), weight.double())
    for b, want in ((None, expected), (bias, expected + bias.double())):
        got = kernels.gemm(x, packed, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # float32 sums in another order, then one bfloat16 rounding of each output.
        scale = want.abs().amax(dim=1, keepdim=True)
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * scale).all()


def test_gemm_reads_strided_rows_and_equals_onednn_within_a_rounding(kernels):
    torch.manual_seed(1)
    wide = torch.randn(37, 1152, dtype=torch.bfloat16)
    x = wide[:, :576]  # rows of a wider tensor, as a split leaves them
    weight = torch.randn(960, 576, dtype=torch.bfloat16)
    got = kernels.gemm(x, kernels.pack_gemm_weight(weight), None)
    onednn = F.linear(x, weight)
    # Both round a float32 sum once; the sums' orders differ, so at most one bfloat16 step.
    assert ((got.float() - onednn.float()).abs() <= 2**-7 * onednn.float().abs() + 1e-3).all()


def test_shapes_it_does_not_take_stay_with_the_caller(kernels):
    assert kernels.pack_gemm_weight(torch.zeros(100, 64, dtype=torch.bfloat16)) is None  # N
    assert kernels.pack_gemm_weight(torch.zeros(64, 63, dtype=torch.bfloat16)) is None  # K odd
    assert kernels.pack_gemm_weight(torch.zeros(64, 64)) is None  # float32


@pytest.mark.parametrize("amx", [False, True])
def test_a_linear_computes_its_row_counts_on_the_kernel_and_on_amx_a_few(kernels, monkeypatch, amx):
    """Every row count takes gemm_bf16; where the CPU has AMX tiles (oneDNN multiplies on
    those) the weight is also packed for oneDNN, which takes PACKED_GEMM_FROM_ROWS rows and
    more, and gemm_bf16 the fewer."""
    monkeypatch.setattr(layers, "cpu_has_amx", lambda: amx)
    calls = []
    gemm = type(kernels).gemm
    monkeypatch.setattr(kernels, "gemm", lambda *a: calls.append(a) or gemm(kernels, *a))
    torch.manual_seed(0)
    layer = Linear(96, 128, bias=True, dtype=torch.bfloat16)
    attach_cpu_kernels(layer, kernels)
    assert layer.gemm_weight is not None
    assert (layer.packed_weight is not None) == amx
    for rows in (1, PACKED_GEMM_FROM_ROWS - 1, PACKED_GEMM_FROM_ROWS, 7, 64):
        calls.clear()
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        got = layer(x)
        assert bool(calls) == (not amx or rows < PACKED_GEMM_FROM_ROWS), rows
        want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-1)
    attach_cpu_kernels(layer, None)  # detached: plain torch, no packed copy kept
    assert layer.gemm_weight is None and layer.packed_weight is None


def test_a_bfloat16_engine_on_it_generates_what_it_generates_on_onednn(kernels, monkeypatch):
    """Greedy, mixed batch sizes."""
    lengths = (1, 5, 17, 40, 3, 90, 2, 8)
    with_gemm, without = greedy_with_and_without_gemm(monkeypatch, "bfloat16", lengths)
    assert with_gemm == without
