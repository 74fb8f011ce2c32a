"""A worker's `run` on a thread of the test, and waiting for what it does."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import redis

from gpu_worker.worker import Worker
from runtime.config import BusConfig


def wait_until(condition: Callable[[], object], timeout_s: float = 60.0) -> float:
    """Poll `condition` until it holds; the seconds that took (fails after `timeout_s`)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.01)
    return time.monotonic() - started


@contextlib.contextmanager
def running(worker: Worker, client: redis.Redis, config: BusConfig) -> Iterator[Worker]:
    """`worker` serving (its first heartbeat written) until the block ends; then stopped."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: client.exists(config.heartbeat_key(worker.worker_id)))
        yield worker
    finally:
        worker.stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
