"""Cancellations that are not lost: at shutdown, and in a request's handler.

A cancellation can be lost: one that lands while `asyncio.wait_for` (Python 3.11) or
redis-py's connection pool is finishing a wait is swallowed, and the task goes on as if
never cancelled (redis-py wraps each send in `wait_for` where a socket timeout is set).

- At shutdown: a loop that sleeps between Redis reads (the background responses' keeper)
  ran on, and a shutdown awaiting it waited for ever: an ingress given SIGTERM never
  stopped, seen in the ingress tests under load. So `cancel_and_wait` cancels the tasks
  again until they end, and gives up on them, with a warning, after `give_up_s`.
- In a handler: aiohttp cancels the handler of a client that left. Lost in one of its
  Redis calls, the handler went on for nobody: a whole answer's job ran to its end, and a
  stream met the closed connection at its end. `raise_if_cancel_lost`, called where a
  handler is about to start or wait for work, raises the cancellation again (what Python
  3.12's `wait_for` does); Python 3.10 cannot tell (no `Task.cancelling`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task], every_s: float = 0.2, give_up_s: float = 5.0
) -> None:
    """Cancel `tasks` and wait for them to end, cancelling those still running again every
    `every_s`; after `give_up_s`, leave the rest (logged)."""
    pending = {task for task in tasks if not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + give_up_s
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
        if pending and loop.time() >= deadline:
            logger.warning("%d tasks did not end when cancelled: %s", len(pending),
                           ", ".join(sorted(task.get_name() for task in pending)))  # fmt: skip
            return


def raise_if_cancel_lost() -> None:
    """Raise CancelledError if this task was cancelled and the cancellation was swallowed
    by what it awaited (the module says where): running with a cancellation requested
    means one was delivered and caught."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError
