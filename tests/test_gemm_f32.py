"""The float32 matmul kernel of CPUs with AVX2 but no AVX-512 (gpu_worker/kernels/gemm_f32.c):
against a float64 reference across its tile, k-block and row-block tails, the shapes it
leaves to oneDNN, a Linear's products of every row count, an engine on it, and the MLP's
gate_up product with SiLU·mul in its epilogue (bit for bit the two calls)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import cpu_kernels
from gpu_worker.kernels.cpu_kernels import MAX_SMALL_M
from gpu_worker.models import layers
from gpu_worker.models.layers import Linear, attach_cpu_kernels
from tests.gemm_engines import greedy_with_and_without_gemm


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_kernels.load()
    assert loaded is not None, "the test machine has a C compiler: the kernels must build"
    if loaded.avx512 or not loaded.vector_extend:
        pytest.skip("gemm_f32 is built for AVX2 and FMA without AVX-512: not this CPU")
    # Where it is built, packing must work: a broken one would skip every test here.
    assert loaded.pack_gemm_weight(torch.zeros(16, 1)) is not None
    return loaded


# Rows: every tail of the 6-row tile, and past one and two 96-row blocks of x.
@pytest.mark.parametrize("rows", [*range(1, 14), 64, 96, 97, 200])
# In features: one k, K whole in one block (344, 600), and three equal blocks of at most 2048
# k's (1367 + 1367 + 1366), each after the first adding into y.
@pytest.mark.parametrize("out_features,in_features", [(16, 1), (48, 344), (32, 600), (32, 4100)])
def test_gemm_matches_float64_reference(kernels, rows, out_features, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    packed = kernels.pack_gemm_weight(weight)
    expected = F.linear(x.double(), weight.double())
    atol = 1e-4 * max(1, in_features / 600)  # float32 rounding grows with the sum's length
    for b, want in ((None, expected), (bias, expected + bias.double())):
        got = kernels.gemm(x, packed, b)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=atol)


def test_shapes_it_does_not_take_are_left_to_onednn(kernels):
    assert kernels.pack_gemm_weight(torch.zeros(24, 8)) is None  # columns not a multiple of 16
    assert kernels.pack_gemm_weight(torch.zeros(16, 8, dtype=torch.bfloat16)) is None
    layer = Linear(8, 24)
    attach_cpu_kernels(layer, kernels)
    assert layer.gemm_weight is None and layer.packed_weight is not None
    assert layer.packed_from_rows == MAX_SMALL_M + 1  # the few-row kernel, then oneDNN
    x = torch.randn(20, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_float32_engine_on_it_generates_what_it_generates_without_it(kernels, monkeypatch):
    """Greedy, mixed batch sizes: decode steps of a few rows, a prefill of up to 266 rows."""
    lengths = (1, 5, 17, 40, 3, 190, 2, 8)
    with_gemm, without = greedy_with_and_without_gemm(monkeypatch, "float32", lengths)
    assert with_gemm == without


def test_a_linear_takes_it_for_every_row_count_and_keeps_no_onednn_copy(kernels, monkeypatch):
    layer = Linear(96, 64, bias=True)
    attach_cpu_kernels(layer, kernels)
    assert layer.gemm_weight is not None and layer.packed_weight is None
    calls = []
    original = type(kernels).gemm
    monkeypatch.setattr(
        type(kernels), "gemm", lambda self, *a: calls.append(a[0].shape[0]) or original(self, *a)
    )
    for rows in (0, 1, 7, 127, 128, 300, 2049):
        calls.clear()
        x = torch.randn(rows, 96)
        got = layer(x)
        assert calls == ([rows] if rows else []), rows  # zero rows: F.linear
        want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        layer.weight.mul_(2)
    layers.repack_cpu_weights(layer)  # weights changed in place: packed anew
    x = torch.randn(5, 96)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    attach_cpu_kernels(layer, None)  # detached: plain torch, no packed copy kept
    assert layer.gemm_weight is None and layer.packed_weight is None


# Rows: the tile's tails and past a 96-row block; [gate | up] of 16 and 48 columns each, K
# of one k and of a block's 600.
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 96, 97, 200])
@pytest.mark.parametrize("out_features,in_features", [(32, 1), (96, 600)])
def test_the_gate_up_product_with_silu_mul_is_bit_for_bit_the_two_calls(
    kernels, rows, out_features, in_features
):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    packed = kernels.pack_gemm_weight(torch.randn(out_features, in_features) * 0.2)
    for bias in (None, torch.randn(out_features)):
        fused = kernels.gemm_silu_mul(x, packed, bias)
        assert torch.equal(fused, kernels.silu_and_mul(kernels.gemm(x, packed, bias)))


def test_shapes_the_fused_activation_does_not_take_are_left_to_the_two_calls(kernels):
    x = torch.randn(3, 4100)
    assert kernels.gemm_silu_mul(x, kernels.pack_gemm_weight(torch.zeros(32, 4100)), None) is None
    halves_of_24 = kernels.pack_gemm_weight(torch.zeros(48, 8))  # gate and up of 24 columns
    assert kernels.gemm_silu_mul(torch.randn(3, 8), halves_of_24, None) is None
    as_bf16 = torch.randn(3, 8, dtype=torch.bfloat16)
    packed = kernels.pack_gemm_weight(torch.zeros(32, 8))
    assert kernels.gemm_silu_mul(as_bf16, packed, None) is None


@torch.no_grad()  # as the engine runs its model (torch's silu is in place)
def test_the_mlp_takes_the_fused_activation_unless_a_hook_must_see_gate_up(kernels, monkeypatch):
    from gpu_worker.models.config import ModelConfig
    from gpu_worker.models.llama import LlamaMLP
    from gpu_worker.models.random_shapes import RANDOM_SHAPES
    from gpu_worker.parallel.shard import ShardPlan, TPShard

    config = ModelConfig.from_hf_dict(RANDOM_SHAPES["tiny-llama"])
    mlp = LlamaMLP(config, torch.float32, ShardPlan(config, TPShard()))
    torch.nn.init.normal_(mlp.gate_up_proj.weight, std=0.2)
    torch.nn.init.normal_(mlp.down_proj.weight, std=0.2)
    x = torch.randn(9, config.hidden_size)
    unfused = mlp(x)  # no kernels attached: torch's silu and mul
    attach_cpu_kernels(mlp, kernels)
    fused_calls = []
    original = type(kernels).gemm_silu_mul
    monkeypatch.setattr(
        type(kernels),
        "gemm_silu_mul",
        lambda self, *a: fused_calls.append(a[0].shape[0]) or original(self, *a),
    )
    torch.testing.assert_close(mlp(x), unfused, rtol=1e-5, atol=1e-5)
    assert fused_calls == [9]
    seen = []
    mlp.gate_up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    torch.testing.assert_close(mlp(x), unfused, rtol=1e-5, atol=1e-5)
    assert fused_calls == [9] and seen == [(9, 2 * mlp.down_proj.in_features)]
