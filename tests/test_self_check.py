"""The start-up self-check of a fast attention path, on CPU backends: right ones pass, wrong
ones are caught and replaced by torch_native."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from gpu_worker import Engine
from gpu_worker.attention import registry
from gpu_worker.attention.torch_native import TorchNativeAttnBackend
from gpu_worker.model_executor.forward_batch import ForwardMode
from gpu_worker.model_executor.graph_runner import DecodeGraphRunner
from gpu_worker.model_executor.self_check import (
    checked_backend,
    compare_backends,
    verified_graphs,
)
from gpu_worker.models.random_shapes import fill_random_weights


class OutputScaledBackend(TorchNativeAttnBackend):
    """Attention output 10% too large: a wrong kernel that still makes plausible logits."""

    def forward(self, q, k, v, layer, forward_batch):
        return super().forward(q, k, v, layer, forward_batch) * 1.1


class StaleDecodeBackend(TorchNativeAttnBackend):
    """Right on prefill; decode reads one key too few (the new token's own key)."""

    def prepare_metadata(self, forward_batch):
        if forward_batch.forward_mode == ForwardMode.DECODE:
            stale = [n - 1 for n in forward_batch.seq_lens_cpu]
            forward_batch = dataclasses.replace(forward_batch, seq_lens_cpu=stale)
        super().prepare_metadata(forward_batch)


# A tiny random model in float32, and the default model in bfloat16 (where a tiny random
# model's logits are too flat for its rounding to leave room to see a wrong kernel).
@pytest.fixture(scope="module", params=["tiny-float32", "smollm2-bfloat16"])
def runner(request):
    if request.param == "tiny-float32":
        engine = Engine("random:tiny-llama", dtype="float32", page_size=4)
        fill_random_weights(engine.runner.model, seed=0, std=0.2)
    else:
        engine = Engine("smollm2-135m-instruct", dtype="bfloat16", page_size=4)
    return engine.runner


def _backend(runner, cls):
    return cls(runner.req_to_token_pool, runner.kv_pool)


@pytest.mark.parametrize("name", ["cpu_kernel", "flashinfer_reference"])
def test_right_backends_pass(runner, name):
    candidate = registry.create_attention_backend(
        name, runner.req_to_token_pool, runner.kv_pool, runner.cpu_kernels
    )
    serving = runner.attn_backend
    result = compare_backends(runner, candidate, _backend(runner, TorchNativeAttnBackend))
    assert result.ok, result.detail
    assert runner.attn_backend is serving  # the check leaves the serving backend in place
    assert not runner.req_to_token_pool.req_to_token.any()  # and the request rows empty


@pytest.mark.parametrize(
    "cls,where", [(OutputScaledBackend, "forward 1"), (StaleDecodeBackend, "forward 2")]
)
def test_wrong_backends_are_caught_where_they_go_wrong(runner, cls, where):
    result = compare_backends(
        runner, _backend(runner, cls), _backend(runner, TorchNativeAttnBackend)
    )
    assert not result.ok
    assert result.detail.startswith(where) and "differ" in result.detail


def test_a_backend_that_fails_is_replaced_by_torch_native(runner, monkeypatch, caplog):
    monkeypatch.setitem(registry._BACKENDS, "stale", f"{__name__}:StaleDecodeBackend")
    with caplog.at_level(logging.ERROR):
        backend, path = checked_backend(runner, "stale")
    assert type(backend) is TorchNativeAttnBackend
    assert path.startswith("torch_native (stale failed its self-check: forward 2")
    assert "disagrees with torch_native" in caplog.text
    backend, path = checked_backend(runner, "flashinfer_reference")
    assert path.startswith("flashinfer_reference (self-check passed")


class UnbuildableBackend(TorchNativeAttnBackend):
    def __init__(self, req_to_token_pool, kv_pool):
        raise ImportError("No module named 'flashinfer'")


def test_a_backend_that_cannot_start_is_replaced_too(runner, monkeypatch):
    monkeypatch.setitem(registry._BACKENDS, "unbuildable", f"{__name__}:UnbuildableBackend")
    backend, path = checked_backend(runner, "unbuildable")
    assert type(backend) is TorchNativeAttnBackend
    assert "failed its self-check: ImportError: No module named 'flashinfer'" in path


class PaddingIntoALiveSlot(DecodeGraphRunner):
    """Pads with the first request's KV slot instead of the padding page's."""

    def padded_batch(self, forward_batch):
        padded = super().padded_batch(forward_batch)
        padded.out_cache_loc[forward_batch.batch_size :] = forward_batch.out_cache_loc[0]
        return padded


@pytest.mark.parametrize("cls", [DecodeGraphRunner, PaddingIntoALiveSlot])
def test_graph_replays_are_checked_against_eager_decoding(cls):
    engine = Engine("random:tiny-llama", dtype="float32", attention_backend="flashinfer_reference")
    fill_random_weights(engine.runner.model, seed=0, std=0.2)
    runner = engine.runner
    graphs = cls(runner, [1, 2, 4])  # the check's 3 requests pad to 4
    assert graphs.unsupported is None  # fixed buffers: the replay path, on CPU
    kept = verified_graphs(runner, graphs)
    assert (kept is graphs) == (cls is DecodeGraphRunner)
    assert runner.graph_runner is None  # the runner decides what to keep
    assert not runner.req_to_token_pool.req_to_token.any()
