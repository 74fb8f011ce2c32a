from __future__ import annotations

import dataclasses
import threading

import pytest

from gpu_worker.model_executor.forward_context import (
    ForwardContext,
    forward_context,
    get_forward_context,
    has_forward_context,
    override_forward_context,
)


def test_getting_context_outside_a_forward_says_how_to_fix_it():
    assert not has_forward_context()
    with pytest.raises(RuntimeError, match="ModelRunner.forward"):
        get_forward_context()


def test_nested_contexts_restore_the_outer_one():
    outer = ForwardContext(attn_backend="outer-backend", forward_batch="batch-1")
    inner = ForwardContext(attn_backend="inner-backend", forward_batch="batch-2")
    with forward_context(outer):
        with forward_context(inner):
            assert get_forward_context() is inner
        assert get_forward_context() is outer
    assert not has_forward_context()


def test_override_builds_a_new_context_and_restores():
    base = ForwardContext(attn_backend="a", forward_batch="b")
    with forward_context(base):
        with override_forward_context(attn_backend="other") as overridden:
            assert overridden is not base
            assert get_forward_context().attn_backend == "other"
            assert get_forward_context().forward_batch == "b"
            with override_forward_context(forward_batch="c"):
                assert get_forward_context() == ForwardContext("other", "c")
        assert get_forward_context() is base
        assert base.attn_backend == "a"


def test_context_is_frozen():
    context = ForwardContext(attn_backend="a", forward_batch="b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.attn_backend = "x"


def test_context_restored_after_an_exception():
    with pytest.raises(KeyError):
        with forward_context(ForwardContext("a", "b")):
            raise KeyError("boom")
    assert not has_forward_context()


def test_each_thread_sees_its_own_context():
    seen = []
    with forward_context(ForwardContext("main", "b")):
        thread = threading.Thread(target=lambda: seen.append(has_forward_context()))
        thread.start()
        thread.join()
        assert get_forward_context().attn_backend == "main"
    assert seen == [False]


def test_capture_context_is_what_traced_code_reads_and_goes_away_after():
    from gpu_worker.model_executor import forward_context as module

    captured = ForwardContext("captured", "b")
    with module.capture_forward_context(captured):
        assert module._capturing is captured  # what TorchDynamo-traced code reads
        assert get_forward_context() is captured  # and eager code, through the ContextVar
    assert module._capturing is None
    assert not has_forward_context()
