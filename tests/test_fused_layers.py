"""Every decoder layer in one C call (gpu_worker/models/fused_layers.py): bit for bit the
layer modules' output, in prefill, chunks, prefix hits, decode and verify, and taken only
where each module would have called the same kernels. bfloat16 where gemm_bf16 multiplies
(AVX512-BF16), float32 where gemm_f32 does (AVX2 without AVX-512): a CPU has one or the
other, and the tests not about the dtype run on the one it has."""

from __future__ import annotations

import random

import pytest

from gpu_worker import Engine
from gpu_worker.kernels import cpu_kernels
from gpu_worker.models import llama
from gpu_worker.models.random_shapes import RANDOM_SHAPES, fill_random_weights

kernels = cpu_kernels.load()
ONE_CALL = kernels is not None and kernels.decoder_layers is not None
BF16 = ONE_CALL and kernels.avx512_bf16
F32 = ONE_CALL and not kernels.avx512 and kernels.vector_extend  # where gemm_f32 is built
DTYPE = "bfloat16" if BF16 else "float32"  # this CPU's, for the tests not about the dtype
pytestmark = pytest.mark.skipif(
    not (BF16 or F32),
    reason="the one-call layers multiply on gemm_bf16 (AVX512-BF16) or gemm_f32 (AVX2 and FMA "
    "without AVX-512)",
)
ON_THIS_CPU = {
    "bfloat16": pytest.mark.skipif(not BF16, reason="gemm_bf16 needs AVX512-BF16"),
    "float32": pytest.mark.skipif(not F32, reason="gemm_f32 is built for AVX2 without AVX-512"),
}


def _generate(shape: str, fused: bool, monkeypatch, dtype: str = DTYPE, **options) -> list:
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(llama, "run_fused_layers", lambda *args: None)
        engine = Engine(f"random:{shape}", dtype=dtype, **options)
        fill_random_weights(engine.runner.model, seed=0, std=0.2)
        rng = random.Random(0)
        shared = [rng.randrange(3, 500) for _ in range(40)]
        prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 17, 40, 3, 90, 8)]
        params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "logprobs": True}
        outputs = []
        # The second round's prompts continue the first's shared prefix: prefix-cache hits.
        for batch in (prompts + [shared], [shared + p for p in prompts[:3]]):
            for out in engine.generate(input_ids=batch, sampling_params=params):
                outputs.append((out["output_ids"], out["logprobs"]))
        model = engine.runner.model.model
        return outputs, model.fused_layers is not None, engine.runner.attn_backend


@pytest.mark.parametrize(
    "shape,options",
    [
        ("tiny-llama", {}),
        ("tiny-llama", {"page_size": 16, "chunked_prefill_size": 24}),
        ("tiny-mistral", {}),
        ("tiny-qwen2-128", {}),  # a qkv bias
        ("tiny-llama", {"speculative": "ngram"}),  # verify steps
    ],
    ids=["default", "pages-chunked", "mistral", "qwen2-bias", "ngram"],
)
@pytest.mark.parametrize("dtype", [pytest.param(d, marks=m) for d, m in ON_THIS_CPU.items()])
def test_one_call_layers_equal_the_modules_bit_for_bit(monkeypatch, shape, options, dtype):
    monkeypatch.setitem(
        RANDOM_SHAPES,
        "tiny-qwen2-128",
        {**RANDOM_SHAPES["tiny-qwen2"], "hidden_size": 128, "num_attention_heads": 8},
    )
    fused, taken, _ = _generate(shape, True, monkeypatch, dtype, **options)
    modules, not_taken, _ = _generate(shape, False, monkeypatch, dtype, **options)
    assert taken and not not_taken
    assert fused == modules  # the tokens and their logprobs, exactly


def test_a_shape_the_extend_kernel_declines_runs_on_the_modules(monkeypatch):
    """16 query heads per kv head: the extend kernel refuses at the first layer, the forward
    goes to the modules (attention on torch from then on), tokens as without the fused call."""
    tiny_mqa = {**RANDOM_SHAPES["tiny-llama"], "num_attention_heads": 16, "num_key_value_heads": 1}
    monkeypatch.setitem(RANDOM_SHAPES, "tiny-mqa", {**tiny_mqa, "head_dim": 16})
    fused, _, backend = _generate("tiny-mqa", True, monkeypatch)
    modules, _, _ = _generate("tiny-mqa", False, monkeypatch)
    assert backend._extend_on_torch
    assert fused == modules


def test_weights_packed_anew_are_the_ones_multiplied(monkeypatch):
    """attach_cpu_kernels (a weight update) drops the layers' pointers: the next forward
    builds them from the new packed weights."""
    from gpu_worker.models.layers import attach_cpu_kernels

    engine = Engine("random:tiny-llama", dtype=DTYPE)
    fill_random_weights(engine.runner.model, seed=0, std=0.2)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    before = engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    fill_random_weights(engine.runner.model, seed=1, std=0.2)
    attach_cpu_kernels(engine.runner.model, engine.runner.cpu_kernels)
    assert engine.runner.model.model.fused_layers is None
    engine.flush_cache()  # the prompt's cached keys are the old weights'
    after = engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    with monkeypatch.context() as patch:
        patch.setattr(llama, "run_fused_layers", lambda *args: None)
        engine.flush_cache()
        expected = engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    assert after == expected and after != before


@pytest.mark.parametrize(
    "target",
    ["model.layers.1.self_attn.attn", "model.layers.1.input_layernorm", "model.layers.0.mlp"],
)
def test_a_hook_on_any_layer_module_sees_it_called(target):
    from tests import hook_factories

    spec = {
        "name": "count",
        "target_modules": target,
        "hook_factory": "tests.hook_factories:count_calls",
        "config": {"key": "fused"},
    }
    engine = Engine("random:tiny-llama", dtype=DTYPE, forward_hooks=[spec])
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert hook_factories.CALLS["fused"] == 4  # one prefill, three decode steps


def test_the_embeddings_a_hook_keeps_are_not_written_over():
    from tests import hook_factories

    hook_factories.KEPT.pop("embeddings", None)
    spec = {
        "name": "keep",
        "target_modules": "model.embed_tokens",
        "hook_factory": "tests.hook_factories:keep_outputs",
        "config": {"key": "embeddings"},
    }
    engine = Engine("random:tiny-llama", dtype=DTYPE, forward_hooks=[spec])
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    kept = hook_factories.KEPT["embeddings"]
    assert kept and all(tensor.equal(copy) for tensor, copy in kept)


@ON_THIS_CPU["bfloat16"]
def test_where_onednn_multiplies_many_rows_only_few_row_forwards_are_one_call(monkeypatch):
    """On a CPU with AMX oneDNN takes the matmuls from PACKED_GEMM_FROM_ROWS rows: there a
    prefill runs on the modules and a one-request decode step in one call."""
    from gpu_worker.models import layers

    monkeypatch.setattr(layers, "cpu_has_amx", lambda: True)
    engine = Engine("random:tiny-llama", dtype=DTYPE)
    rows = []
    # The engine's kernels: another test may have loaded the library anew since this
    # module's import.
    call = engine.runner.cpu_kernels.decoder_layers

    def counted(weights, run):
        rows.append(run._obj.tokens)
        return call(weights, run)

    monkeypatch.setattr(engine.runner.cpu_kernels, "decoder_layers", counted)
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    engine.generate(input_ids=[5, 6, 7, 8], sampling_params=params)
    assert rows == [1, 1, 1]  # the three decode steps, not the 4-token prefill
