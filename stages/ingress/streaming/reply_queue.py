"""A submission's queue of replies (streaming/submission.py), and what else its handler may
find there: the watchdog's `TIMED_OUT`, a relay's `NUDGE` to write, a relayed reply's
`Failed` handling."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

TIMED_OUT: Any = object()  # queued by the watchdog: no reply for reply_timeout_s
NUDGE: Any = object()  # queued by a relay that could not write: the handler writes


class Failed:
    """Queued for a relayed reply whose handling raised: the handler raises it."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class ReplyQueue(asyncio.Queue):
    """A submission's replies; one its relay takes (`Submission._relayed`) is not queued.

    It holds its relay, a method of the submission that holds it, weakly: a strong one made
    every request a reference cycle (the submission, its queue, their deques and lists),
    freed only by the garbage collector's walks of the older generations, ~10 objects a
    request the ingress's collections had to find (bench_bus_load.py at 128 clients).
    """

    def __init__(self, relay: Callable[[Any], bool]) -> None:
        super().__init__()
        self._relay = weakref.WeakMethod(relay)  # type: ignore[arg-type]

    def put_nowait(self, item: Any) -> None:
        relay = self._relay()
        if relay is None or not relay(item):
            super().put_nowait(item)
