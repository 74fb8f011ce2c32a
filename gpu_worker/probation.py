"""Probation: the jobs that were in a step that raised, admitted again one at a time.

When a step raises, the job that caused it cannot be told apart from the others in the
batch. The worker starts its engine afresh and admits every job again from its published
progress (gpu_worker/worker.py); each job that was in the failed batch gets a strike. A job
with strikes enters the engine only when no other such job is still on trial there, and is
cleared once it gets a token: so a poison job fails alone the next time, collecting strikes
until it is set aside (``max_deliveries``), while the jobs that were merely beside it go
through. Jobs without strikes are never held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")  # what the worker holds for a job on probation (its request)


class Probation(Generic[T]):
    def __init__(self) -> None:
        self.strikes: dict[str, int] = {}
        self._queue: deque[tuple[str, T]] = deque()
        self.on_trial: str | None = None  # in the engine, not yet given a token

    def strike(self, rids: Iterable[str]) -> None:
        """The step these jobs were in raised."""
        for rid in rids:
            self.strikes[rid] = self.strikes.get(rid, 0) + 1
        # Everything in the engine is dropped and admitted again: no trial runs any more.
        self._queue.clear()
        self.on_trial = None

    def hold(self, rid: str, item: T) -> bool:
        """Queue a struck job's item for `release`; False (not held) for a job without strikes."""
        if not self.strikes.get(rid):
            return False
        self._queue.append((rid, item))
        return True

    def release(self) -> T | None:
        """The next held item to start, when no job is on trial."""
        if self.on_trial is not None or not self._queue:
            return None
        self.on_trial, item = self._queue.popleft()
        return item

    def passed(self, rid: str) -> None:
        """The job got a token (or ended): the next one may go on trial."""
        if self.on_trial == rid:
            self.on_trial = None

    def forget(self, rid: str) -> T | None:
        """The job is gone (finished, aborted, set aside); its held item if it had one."""
        self.strikes.pop(rid, None)
        self.passed(rid)
        for index, (held, item) in enumerate(self._queue):
            if held == rid:
                del self._queue[index]
                return item
        return None

    def clear(self) -> None:
        """Every job dropped (the worker was fenced off): keep the counts, hold nothing."""
        self._queue.clear()
        self.on_trial = None
