"""Cancelling asyncio tasks at shutdown so that the shutdown ends.

A cancellation can be lost: one that lands while `asyncio.wait_for` (Python 3.11) or
redis-py's connection pool is finishing a wait is swallowed, and the task goes on as if
never cancelled. A loop that sleeps between Redis reads (the background responses' keeper)
then runs on, and a shutdown awaiting it waits for ever: an ingress given SIGTERM never
stopped, seen in the ingress tests under load. So the tasks are cancelled again until
they end, and given up on, with a warning, after `give_up_s`.
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
