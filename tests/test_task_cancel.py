"""Cancellations not lost (runtime/task_cancel.py). Shutdown cancels tasks until they end:
a task that loses a cancellation, as one can inside asyncio.wait_for or redis-py's pool,
still ends; one that never does is given up on, so the shutdown ends either way. A handler
whose cancellation was lost raises it again where it would start or wait for work."""

from __future__ import annotations

import asyncio
import time

from runtime.task_cancel import cancel_and_wait, raise_if_cancel_lost


async def _loses_one_cancellation() -> None:
    lost = False
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True  # as a cancellation swallowed mid-wait: the loop goes on


async def _ends_only_when(released: list[bool]) -> None:
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if released:
                raise


def test_a_task_that_lost_a_cancellation_is_cancelled_again_and_ends():
    async def main() -> bool:
        task = asyncio.get_running_loop().create_task(_loses_one_cancellation())
        await asyncio.sleep(0.01)
        await asyncio.wait_for(cancel_and_wait([task], every_s=0.05), timeout=5)
        return task.cancelled()

    assert asyncio.run(main())


def test_a_task_that_never_ends_is_given_up_on(caplog):
    async def main() -> float:
        released: list[bool] = []
        task = asyncio.get_running_loop().create_task(_ends_only_when(released), name="stubborn")
        await asyncio.sleep(0.01)
        started = time.monotonic()
        await cancel_and_wait([task], every_s=0.05, give_up_s=0.3)
        took = time.monotonic() - started
        assert not task.done()
        released.append(True)  # let the test's loop end
        await cancel_and_wait([task])
        return took

    assert asyncio.run(main()) < 2
    assert "stubborn" in caplog.text


def test_a_cancellation_lost_in_a_wait_is_raised_again_where_work_would_start():
    # A cancellation landing as the awaited future completes: Python 3.11's wait_for
    # returns the result and drops it (as it does inside redis-py's sends), 3.12's raises.
    async def handler(ready: asyncio.Future) -> str:
        await asyncio.wait_for(ready, timeout=5)
        raise_if_cancel_lost()
        return "went on for nobody"

    async def main() -> bool:
        ready = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(handler(ready))
        await asyncio.sleep(0)  # the handler waits
        ready.set_result(None)
        task.cancel()  # in the same turn
        await asyncio.wait([task])
        return task.cancelled()

    assert asyncio.run(main())


def test_a_task_not_cancelled_goes_on():
    async def main() -> str:
        raise_if_cancel_lost()
        return "on"

    assert asyncio.run(main()) == "on"
