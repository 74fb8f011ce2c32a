"""The model side of streamserve: the engine loop, KV memory, ModelRunner, models, sampling."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_worker.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str):
    # Import lazily: `import gpu_worker` should not pay for torch until the engine is used.
    if name == "Engine":
        from gpu_worker.engine import Engine

        return Engine
    raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
