"""The CUDA-graph runner's bucketing, padding and static buffers, on CPU: an eager forward
over the static buffers stands in for the replay."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.model_executor.graph_runner import (
    DEFAULT_CAPTURE_SIZES,
    DecodeGraphRunner,
    capture_sizes,
)
from gpu_worker.models.random_shapes import fill_random_weights


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(256) == DEFAULT_CAPTURE_SIZES
    assert capture_sizes(20) == [1, 2, 4, 8, 12, 16, 20]
    assert capture_sizes(1) == [1]
    assert capture_sizes(6, [4, 2, 64]) == [2, 4, 6]


@pytest.fixture(scope="module")
def tiny_engine():
    engine = Engine("random:tiny-llama", dtype="float32")
    fill_random_weights(engine.runner.model, seed=0, std=0.2)
    return engine


def test_batches_pad_to_the_next_size_and_past_the_largest_run_eager(tiny_engine):
    graphs = DecodeGraphRunner(tiny_engine.runner, [1, 2, 4, 8])
    assert [graphs.padded_size(bs) for bs in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphRunner(tiny_engine.runner, [4, 2])


def _decode_batch(bs: int) -> ForwardBatch:
    ids = torch.arange(10, 10 + bs)
    return ForwardBatch(
        ForwardMode.DECODE, bs, ids, ids + 5, torch.arange(bs), ids + 6, ids + 100,
        [int(n) for n in ids + 6], [1] * bs, [int(n) for n in ids + 5],
    )  # fmt: skip


def test_a_padded_batch_lives_in_the_same_buffers_with_one_key_padding_rows(tiny_engine):
    graphs = DecodeGraphRunner(tiny_engine.runner, [1, 2, 4, 8])
    first = graphs.padded_batch(_decode_batch(3))
    assert first.batch_size == 4
    assert first.input_ids.tolist() == [10, 11, 12, 0]
    assert first.seq_lens.tolist() == [16, 17, 18, 1]
    assert first.out_cache_loc.tolist() == [110, 111, 112, 0]  # slot 0: the padding page
    assert first.seq_lens_cpu == [16, 17, 18, 1]
    assert first.extend_prefix_lens_cpu == [15, 16, 17, 0]
    second = graphs.padded_batch(_decode_batch(5))
    assert second.batch_size == 8
    for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc"):
        assert getattr(second, name).data_ptr() == getattr(first, name).data_ptr(), name
    # A smaller batch after a larger one: the larger one's rows are padding again.
    assert graphs.padded_batch(_decode_batch(1)).input_ids.tolist() == [10]
    assert graphs.input_ids[1:8].tolist() == [11, 12, 13, 14, 0, 0, 0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"page_size": 16},
        # Metadata prepared into fixed buffers outside the forward, as a replay reads it.
        {"attention_backend": "flashinfer_reference", "page_size": 16},
    ],
    ids=["page-1", "page-16", "flashinfer-fixed-buffers"],
)
def test_decoding_through_the_runner_equals_eager(options):
    """Seven requests finishing at different steps: batches of 7, 6 and 5 (eager, past the
    largest size), 3 (padded to 4), 2 and 1 (exact)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 17, 40, 3, 60, 9)]
    params = [
        {"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (3, 5, 9, 10, 5, 12, 4)
    ]
    outputs, padded = {}, []
    for use_graphs in (False, True):
        engine = Engine("random:tiny-llama", dtype="float32", **options)
        fill_random_weights(engine.runner.model, seed=0, std=0.2)
        if use_graphs:
            graphs = DecodeGraphRunner(engine.runner, [1, 2, 4])
            fixed_buffers = options.get("attention_backend") == "flashinfer_reference"
            assert (graphs.unsupported is None) == fixed_buffers
            pad = graphs.padded_batch

            def padded_batch(batch, pad=pad):
                result = pad(batch)
                padded.append((batch.batch_size, result.batch_size))
                return result

            graphs.padded_batch = padded_batch
            engine.runner.graph_runner = graphs
        results = engine.generate(input_ids=prompts, sampling_params=params)
        outputs[use_graphs] = [r["output_ids"] for r in results]
    assert outputs[True] == outputs[False]
    assert {(3, 4), (2, 2), (1, 1)} <= set(padded)
    assert all(bs <= 4 for bs, _ in padded)  # 5, 6 and 7 ran eager


def test_capture_needs_cuda_and_a_backend_with_fixed_buffers(tiny_engine):
    assert tiny_engine.runner.graph_runner is None  # on CPU the engine decodes eager
    graphs = DecodeGraphRunner(tiny_engine.runner, [1, 2])
    assert "does not support CUDA graphs" in graphs.unsupported  # cpu_kernel
    with pytest.raises(RuntimeError, match="CUDA"):
        graphs.capture()


def test_replays_read_one_set_of_fixed_buffers():
    engine = Engine("random:tiny-llama", dtype="float32", attention_backend="flashinfer_reference")
    graphs = DecodeGraphRunner(engine.runner, [1, 2, 4])
    engine.runner.graph_runner = graphs
    backend = engine.runner.attn_backend
    seen = set()
    plan = backend.kernels.plan_graph

    def plan_graph(meta, layer, dtype):
        seen.add((meta.kv_indptr.data_ptr(), meta.kv_indices.data_ptr()))
        plan(meta, layer, dtype)

    backend.kernels.plan_graph = plan_graph
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    engine.generate(input_ids=[[5, 6, 7], [8, 9], [10]], sampling_params=params)
    fixed = backend._fixed
    assert seen == {(fixed.kv_indptr.data_ptr(), fixed.kv_indices.data_ptr())}
