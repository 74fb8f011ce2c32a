"""The CPU kernels (gpu_worker/kernels): each against a float64 reference, the engine with
them against the engine without, and the fallback where they cannot be built."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from gpu_worker import Engine
from gpu_worker.kernels import cpu_kernels
from gpu_worker.kernels.cpu_kernels import MAX_SMALL_M
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.models.layers import RMSNorm
from gpu_worker.models.random_shapes import RANDOM_SHAPES, fill_random_weights
from gpu_worker.models.rotary import RotaryEmbedding, apply_rotary
from tests.extend_chunks import EXTEND_SHAPES, extend_case, reference_extend


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_kernels.load()
    assert loaded is not None, "the test machine has a C compiler: the kernels must build"
    return loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, MAX_SMALL_M + 1))
@pytest.mark.parametrize("in_features", [64, 100])  # 100: a tail past the vector loop
def test_linear_matches_float64_reference(kernels, dtype, rows, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features, dtype=dtype)
    weight = torch.randn(70, in_features, dtype=dtype)
    bias = torch.randn(70, dtype=dtype)
    expected = F.linear(x.double(), weight.double(), bias.double())
    for b, want in ((bias, expected), (None, expected - bias.double())):
        got = kernels.linear(x, weight, b)
        assert got.dtype == dtype and got.shape == (rows, 70)
        # float32: summation order only; bfloat16: one rounding of the output.
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * 10)


def _reference_decode(q, k_cache, v_cache, table, rows, lens, scale):
    """Plain attention of one query per request over its slots, in float64."""
    kv_heads = k_cache.shape[0]
    out = []
    for b in range(q.shape[0]):
        slots = table[rows[b], : lens[b]]
        keys, values = k_cache[:, slots].double(), v_cache[:, slots].double()
        queries = q[b].double().view(kv_heads, -1, q.shape[-1])  # [kv_heads, group, dim]
        probs = (torch.einsum("kgd,knd->kgn", queries, keys) * scale).softmax(-1)
        out.append(torch.einsum("kgn,knd->kgd", probs, values).reshape(q.shape[1], -1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "head_dim,heads,kv_heads",
    [(64, 9, 3), (64, 8, 2), (64, 4, 4), (64, 12, 2), (40, 4, 4), (16, 8, 2)],
)
@pytest.mark.parametrize("chunk", [1, 7, 32, 256])
def test_paged_decode_attention_matches_reference(kernels, dtype, head_dim, heads, kv_heads, chunk):
    rng = random.Random(chunk + head_dim)
    torch.manual_seed(chunk)
    slots = 3000
    # Head-major like the pool, and a strided view of a wider buffer, as a layer's slice is.
    k_cache = torch.randn(kv_heads, slots, head_dim + 8, dtype=dtype)[..., :head_dim]
    v_cache = torch.randn(kv_heads, slots, head_dim + 8, dtype=dtype)[..., :head_dim]
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    table = torch.tensor([rng.sample(range(slots), 600) for _ in range(12)])
    lens = torch.tensor([1, 2, 31, 33, 600, 257, 64])
    rows = torch.tensor(rng.sample(range(12), len(lens)))
    # Rows strided, as q is a slice of the layer's fused qkv output.
    q = torch.randn(len(lens), heads + 2, head_dim, dtype=dtype)[:, :heads]
    out = torch.empty(q.shape, dtype=dtype)
    kernels.paged_decode_attention(q, k_cache, v_cache, table, rows, lens, 0.3, chunk, out)
    expected = _reference_decode(q, k_cache, v_cache, table, rows, lens, 0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", EXTEND_SHAPES)
def test_extend_attention_matches_reference(kernels, dtype, head_dim, heads, kv_heads):
    args = extend_case(dtype, head_dim, heads, kv_heads)
    out = torch.empty(args[0].shape, dtype=dtype)
    handled = kernels.extend_attention(*args, out)
    if heads // kv_heads > 8 or not kernels.vector_extend:
        # More query heads per kv head than the kernel holds, or a CPU without AVX-512 or AVX2: the
        # caller attends on the torch path (test_engine_with_kernels_equals_engine_without).
        assert not handled
        return
    assert handled
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    expected = reference_extend(*args)
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 200])  # 200: past the size that goes parallel
def test_rms_norm_matches_the_torch_layer(kernels, dtype, rows):
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = torch.randn(rows, 576, dtype=dtype) * 3
    expected = norm(x)  # no kernels attached: transformers' op sequence
    got = kernels.rms_norm(x, norm.weight.detach(), norm.eps)
    # float32: summation order; bfloat16: the same roundings, so at most one ulp apart.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 100), (200, 576)])  # 100: a tail
def test_add_rms_norm_matches_the_add_then_the_torch_layer(kernels, dtype, rows, hidden):
    torch.manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x, residual = torch.randn(rows, hidden, dtype=dtype) * 3, torch.randn(rows, hidden, dtype=dtype)
    total = residual + x  # the decoder layer's add, then its norm: transformers' ops
    expected = norm(total)
    got_total, got = kernels.add_rms_norm(x, residual, norm.weight.detach(), norm.eps)
    assert torch.equal(got_total, total)  # one rounded add either way
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    # The layer's fused path is the kernel; with a hook on the norm it calls the module.
    norm.cpu_kernels = kernels
    assert torch.equal(norm.add_then_norm(x, residual)[1], got)
    seen = []
    norm.register_forward_hook(lambda module, args, out: seen.append(out))
    hooked_total, hooked = norm.add_then_norm(x, residual)
    assert len(seen) == 1 and torch.equal(hooked_total, total) and hooked is seen[0]
    # Written over its operands: the same values, in residual's and x's memory.
    x_copy, residual_copy = x.clone(), residual.clone()
    over_total, over = kernels.add_rms_norm(
        x_copy, residual_copy, norm.weight.detach(), norm.eps, True
    )
    assert (
        over_total.data_ptr() == residual_copy.data_ptr() and over.data_ptr() == x_copy.data_ptr()
    )
    assert torch.equal(over_total, got_total) and torch.equal(over, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotary_in_place_matches_apply_rotary(kernels, dtype, tokens):
    torch.manual_seed(tokens)
    heads, head_dim = 12, 64
    rotary = RotaryEmbedding(head_dim, 10000.0, None)
    cos, sin = rotary(torch.arange(tokens) * 7, dtype)
    # A strided view, as q and k sit inside the fused qkv output.
    qkv = torch.randn(tokens, heads * head_dim + 192, dtype=dtype)
    x = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    expected = apply_rotary(x.clone(), cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()
    kernels.rotary_inplace(x, cos, sin)
    tolerance = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(x, expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: past the size that goes parallel
def test_silu_and_mul_matches_torch_ops(kernels, rows):
    torch.manual_seed(rows)
    inter = 1536 + 8  # a tail past the vector loop
    # A strided view, as from a fused gate_up output; wide values reach silu's flat tails.
    gate_up = (torch.randn(rows, 2 * inter + 64) * 6).to(torch.bfloat16)[:, : 2 * inter]
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate).mul(up)  # torch's two bfloat16 ops
    got = kernels.silu_and_mul(gate_up)
    if not kernels.avx512:
        assert got is None  # the MLP keeps torch's ops on this CPU
        return
    # The same two roundings; exp's last float32 bit may move a rounding by one bfloat16 ulp.
    torch.testing.assert_close(got, expected, rtol=8e-3, atol=1e-6)
    assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_float32_silu_and_mul_is_as_close_to_exact_as_torchs(kernels, rows):
    torch.manual_seed(rows)
    inter = 1536 + 5  # a tail past the vector loop
    gate_up = (torch.randn(rows, 2 * inter + 64) * 6)[:, : 2 * inter]
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate).mul(up)
    got = kernels.silu_and_mul(gate_up)
    if not kernels.vector_extend:
        assert got is None  # neither AVX2 with FMA nor AVX-512: torch's ops
        return
    # Ulps from silu in float64, rounded once to float32, times up in float64.
    g, u = gate.double(), up.double()
    exact = ((g / (1 + torch.exp(-g))).float().double() * u).float()

    def ulps(x: torch.Tensor) -> torch.Tensor:
        return (x.view(torch.int32).long() - exact.view(torch.int32).long()).abs()

    assert ulps(got).max() <= max(ulps(expected).max().item(), 4)
    assert ulps(got).double().mean() <= ulps(expected).double().mean() * 1.2 + 0.01
    assert (got == expected).float().mean() > 0.9  # the rest one ulp apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_keeps_torchs_results_at_the_extremes(kernels, dtype):
    # exp(-g) overflowing to +inf below about -88.7 (silu -0), infinities and NaN.
    inf, nan = float("inf"), float("nan")
    gate = [-1e3, -100, -89.5, -88.9, -88.6, -88, -50, -10, -0.0, 0.0, 10, 100, inf, -inf, nan, 3]
    gate_up = torch.tensor([gate + [1.5] * 16], dtype=dtype)
    got = kernels.silu_and_mul(gate_up)
    if got is None:
        return  # no vector path for this dtype here: torch's ops
    expected = F.silu(gate_up[:, :16]).mul(gate_up[:, 16:])
    # Bit for bit: bfloat16's roundings absorb exp's last bit; float32 keeps it (one ulp).
    rtol = 0.0 if dtype == torch.bfloat16 else 2.4e-7
    torch.testing.assert_close(got, expected, rtol=rtol, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got[:, :13]), torch.signbit(expected[:, :13]))  # -0 too


@pytest.mark.parametrize("rows,cols", [(1, 5), (3, 49152 + 7), (64, 1000)])
def test_argmax_equals_torch_argmax_on_ties_nan_and_infinities(kernels, rows, cols):
    torch.manual_seed(cols)
    # bfloat16 values in float32 rows, as the logits are: ties are common. Rows strided.
    x = torch.randn(rows, cols + 9).bfloat16().float()[:, :cols]
    x[0, cols // 2] = x[0, cols - 1] = x[0].max() + 1  # a tie: the first position wins
    if rows > 2:
        x[1] = float("-inf")  # every value -inf: position 0, as torch says
        x[2, cols // 3] = x[2, cols // 5] = float("nan")  # NaN is the maximum: the first one
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("rows,cols", [(1, 40), (5, 1000), (64, 49152)])  # 64: parallel
def test_token_bitmask_equals_the_torch_mask(kernels, rows, cols):
    from gpu_worker.sampling.grammar import GrammarMask

    generator = torch.Generator().manual_seed(rows)
    words = (cols + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32,
                            generator=generator)  # fmt: skip
    bitmask[::2, ::3] = -1  # whole words allowed: the kernel's shortcut
    x = torch.randn(rows + 2, cols, generator=generator)
    mask = GrammarMask(torch.arange(1, rows + 1), bitmask)  # the batch's first row has none
    expected, got = x.clone(), x.clone()
    mask.apply(expected)
    mask.apply(got, kernels)
    assert torch.equal(got, expected)
    assert torch.equal(got[0], x[0]) and torch.isinf(got).any()


@pytest.mark.parametrize("new_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_what_set_kv_buffer_stores(kernels, new_dtype, pool_dtype):
    torch.manual_seed(0)
    kv_heads, head_dim, tokens = 3, 64, 5
    # k and v as the model hands them over: column slices of the fused qkv output.
    qkv = torch.randn(tokens, 9 * head_dim + 2 * kv_heads * head_dim, dtype=new_dtype)
    k = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim]
    v = qkv[:, (9 + kv_heads) * head_dim :]
    loc = torch.tensor([7, 3, 40, 41, 12])
    expected = TokenToKVPool(64, 1, pool_dtype, 1, kv_heads, head_dim, "cpu")
    got = TokenToKVPool(64, 1, pool_dtype, 1, kv_heads, head_dim, "cpu")
    expected.set_kv_buffer(0, loc, k.view(tokens, kv_heads, head_dim),
                           v.view(tokens, kv_heads, head_dim))  # fmt: skip
    kernels.write_kv(k, v, loc, *got.get_kv_buffer(0))
    assert torch.equal(got.k_buffer[0], expected.k_buffer[0])
    assert torch.equal(got.v_buffer[0], expected.v_buffer[0])


def test_paged_decode_attention_refuses_what_it_cannot_hold(kernels):
    q = torch.randn(1, 32, 8)  # a group of 32 query heads per kv head: more than it holds
    cache = torch.randn(1, 10, 8)
    table = torch.zeros(1, 10, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="status -1"):
        kernels.paged_decode_attention(
            q, cache, cache, table, torch.zeros(1, dtype=torch.int64),
            torch.tensor([4]), 1.0, 32, torch.empty_like(q),
        )  # fmt: skip


@pytest.mark.parametrize(
    "shape,options",
    [
        ("tiny-llama", {}),
        ("tiny-llama", {"page_size": 16, "chunked_prefill_size": 24}),
        ("tiny-llama", {"speculative": "ngram"}),
        ("tiny-mqa", {"chunked_prefill_size": 24}),  # 16 query heads per kv head
    ],
    ids=["default", "pages-chunked", "ngram", "extend-on-torch"],
)
def test_engine_with_kernels_equals_engine_without(monkeypatch, shape, options):
    """float32 greedy, mixed lengths (batch sizes above and below the kernel's row limit)."""
    # More query heads per kv head than the extend kernel holds: extends go to the torch path.
    tiny_mqa = {**RANDOM_SHAPES["tiny-llama"], "num_attention_heads": 16, "num_key_value_heads": 1}
    monkeypatch.setitem(RANDOM_SHAPES, "tiny-mqa", {**tiny_mqa, "head_dim": 16})
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 17, 40, 3, 90, 2, 8, 60)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outputs = {}
    for enabled in (True, False):
        engine = Engine(f"random:{shape}", dtype="float32", cpu_kernels=enabled, **options)
        # A wide init makes the logits peaked: float32 summation order cannot flip a choice.
        fill_random_weights(engine.runner.model, seed=0, std=0.2)
        assert (engine.runner.cpu_kernels is not None) == enabled
        expected_backend = "CpuKernelAttnBackend" if enabled else "TorchNativeAttnBackend"
        assert type(engine.runner.attn_backend).__name__ == expected_backend
        outputs[enabled] = [
            r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)
        ]
        if enabled:
            on_torch = shape == "tiny-mqa" or not engine.runner.cpu_kernels.vector_extend
            assert engine.runner.attn_backend._extend_on_torch == on_torch
    assert outputs[True] == outputs[False]


def test_no_compiler_serves_on_torch_ops_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("STREAMSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="gpu_worker.kernels.cpu_kernels"):
            engine = Engine("random:tiny-llama", dtype="float32")
        assert engine.runner.cpu_kernels is None
        assert type(engine.runner.attn_backend).__name__ == "TorchNativeAttnBackend"
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "could not build the CPU kernels" in caplog.records[0].message
        result = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3})
        assert len(result["output_ids"]) == 3
    finally:
        cpu_kernels.load.cache_clear()


def test_kernels_can_be_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv("STREAMSERVE_CPU_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        cpu_kernels.load.cache_clear()


def test_cpu_kernel_backend_named_without_kernels_is_refused():
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        Engine("random:tiny-llama", attention_backend="cpu_kernel", cpu_kernels=False)


def test_worker_flags_turn_a_default_true_option_off():
    import argparse

    from gpu_worker.cli import _engine_option_arguments

    parser = argparse.ArgumentParser()
    _engine_option_arguments(parser)
    assert parser.parse_args(["--no-cpu-kernels"]).cpu_kernels is False
    assert parser.parse_args(["--disable-radix-cache"]).disable_radix_cache is True
    assert parser.parse_args([]).cpu_kernels is None  # unset: EngineConfig's default
