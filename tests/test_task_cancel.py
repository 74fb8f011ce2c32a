"""Shutdown cancels tasks until they end (runtime/task_cancel.py): a task that loses a
cancellation, as one can inside asyncio.wait_for or redis-py's pool, still ends; one that
never does is given up on, so the shutdown ends either way."""

from __future__ import annotations

import asyncio
import time

from runtime.task_cancel import cancel_and_wait


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
