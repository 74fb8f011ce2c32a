"""The decode step a CUDA graph would capture, compiled whole on CPU: a host sync or a
data-dependent shape in it breaks the graph, and these tests."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.model_executor.forward_context import (
    ForwardContext,
    capture_forward_context,
    forward_context,
)
from gpu_worker.models.random_shapes import fill_random_weights


@pytest.fixture
def engine_and_decode_batch():
    # torch ops only: the C kernels are CPU code, called through ctypes, never captured.
    engine = Engine(
        "random:tiny-llama", dtype="float32", cpu_kernels=False, attention_backend="torch_native"
    )
    fill_random_weights(engine.runner.model, seed=0, std=0.2)
    batches: list[ForwardBatch] = []
    forward = engine.runner.forward

    def keep_decode_batches(forward_batch):
        if forward_batch.forward_mode == ForwardMode.DECODE:
            batches.append(forward_batch)
        return forward(forward_batch)

    engine.runner.forward = keep_decode_batches
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    engine.generate(input_ids=[[5, 6, 7], [8, 9], list(range(10, 40))], sampling_params=params)
    torch.compiler.reset()
    yield engine, batches[-1]
    torch.compiler.reset()


def _decode_step(engine, forward_batch):
    runner = engine.runner

    def step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = runner.model(input_ids, positions)
        return runner.model.compute_logits(hidden[forward_batch.last_token_indices()])

    return step


def test_the_decode_step_compiles_as_one_graph_with_the_eager_answer(engine_and_decode_batch):
    engine, batch = engine_and_decode_batch
    backend = engine.runner.attn_backend
    step = _decode_step(engine, batch)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    with torch.inference_mode():
        backend.prepare_metadata(batch)  # outside the graph, as before a replay
        with forward_context(ForwardContext(backend, batch)):
            expected = step(batch.input_ids, batch.positions)
        with capture_forward_context(ForwardContext(backend, batch)):
            got = compiled(batch.input_ids, batch.positions)
    assert got.shape == (batch.batch_size, engine.runner.model_config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_host_sync_in_the_decode_step_fails_the_compile(engine_and_decode_batch, monkeypatch):
    engine, batch = engine_and_decode_batch
    backend = engine.runner.attn_backend
    store = backend.kv_pool.set_kv_buffer

    def store_after_a_sync(layer_id, loc, k, v):
        if int(loc.max()) >= 0:  # a device-to-host read, as .item() or .tolist() would be
            store(layer_id, loc, k, v)

    monkeypatch.setattr(backend.kv_pool, "set_kv_buffer", store_after_a_sync)
    compiled = torch.compile(_decode_step(engine, batch), fullgraph=True, backend="eager")
    with torch.inference_mode():
        backend.prepare_metadata(batch)
        with capture_forward_context(ForwardContext(backend, batch)):
            with pytest.raises(torch._dynamo.exc.TorchDynamoException):
                compiled(batch.input_ids, batch.positions)
