"""ForwardContext: the runtime objects a model forward needs, published for its duration.

The model's layers take tensors only. The attention layers find the backend (which holds
the KV pools) and the batch metadata here. A context is frozen; an override builds a new
one and restores the previous one on exit, so nested overrides compose.

Threading: the context lives in a `contextvars.ContextVar`, so each thread (and each
asyncio task) sees its own. A forward runs on the thread that entered the context.

Capture: TorchDynamo cannot read a ContextVar, so a forward traced for capture (a CUDA
graph, or the CPU suite's fullgraph compile of the decode step) runs inside
`capture_forward_context`, which also publishes the context in a plain module attribute
that the traced code reads. Capturing happens once, on one thread, before serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpu_worker.attention.base import AttentionBackend
    from gpu_worker.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class ForwardContext:
    attn_backend: AttentionBackend
    forward_batch: ForwardBatch


_current: ContextVar[ForwardContext | None] = ContextVar("forward_context", default=None)
_capturing: ForwardContext | None = None  # see "Capture" above


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Publish `context` for the block; the previous context (if any) comes back after."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


@contextmanager
def override_forward_context(**changes: Any) -> Iterator[ForwardContext]:
    """Publish a copy of the current context with some fields replaced."""
    with forward_context(dataclasses.replace(get_forward_context(), **changes)) as context:
        yield context


@contextmanager
def capture_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """`forward_context` for a forward that TorchDynamo traces (see "Capture" above)."""
    global _capturing
    previous, _capturing = _capturing, context
    try:
        with forward_context(context):
            yield context
    finally:
        _capturing = previous


def get_forward_context() -> ForwardContext:
    context = _capturing if torch.compiler.is_compiling() else _current.get()
    if context is None:
        raise RuntimeError(
            "no ForwardContext is set: run the model through ModelRunner.forward, or wrap "
            "the call in `with forward_context(ForwardContext(backend, forward_batch)):`"
        )
    return context


def has_forward_context() -> bool:
    return _current.get() is not None
