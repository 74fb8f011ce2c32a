"""A submission's queue of replies (streaming/submission.py), and what else its handler may
find there: the watchdog's `TIMED_OUT`, a relay's `NUDGE` to write, a relayed reply's
`Failed` handling."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

TIMED_OUT: Any = object()  # queued by the watchdog: no reply for reply_timeout_s
NUDGE: Any = object()  # queued by a relay that could not write: the handler writes


class Failed:
    """Queued for a relayed reply whose handling raised: the handler raises it."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class ReplyQueue(asyncio.Queue):
    """A submission's replies; one its relay takes (`Submission._relayed`) is not queued."""

    def __init__(self, relay: Callable[[Any], bool]) -> None:
        super().__init__()
        self._relay = relay

    def put_nowait(self, item: Any) -> None:
        if not self._relay(item):
            super().put_nowait(item)
