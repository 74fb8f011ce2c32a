"""The event loop an asyncio process runs on: uvloop where it is installed, else asyncio's.

The ingress spends its CPU on many small events (a socket write per stream per publish, a
callback per reply, a read per Redis reply), and asyncio's loop and transports are Python;
uvloop's (libuv, in C) cost the ingress ~4% less CPU per token under load
(`bench_bus_load.py`, benchmarks/NOTES.md 2026-11-26 night). It is a dependency where it
builds (not on Windows); where it is not installed the process runs on asyncio's loop.
``STREAMSERVE_EVENT_LOOP=asyncio`` picks asyncio's loop where uvloop is installed (to rule
the loop out when tracking a fault down); ``uvloop`` insists on uvloop.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

ENV = "STREAMSERVE_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


def loop_name(environ: Mapping[str, str] = os.environ) -> str:
    """``uvloop`` or ``asyncio``: the loop `run` uses. ValueError for a choice it does not
    know, or for uvloop asked for by name where it is not installed."""
    choice = environ.get(ENV, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return "asyncio"
    if importlib.util.find_spec("uvloop") is None:
        if choice == "uvloop":
            raise ValueError(f"{ENV}=uvloop, but uvloop is not installed")
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_name` picks."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
