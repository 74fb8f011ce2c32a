"""A worker's `run` on a thread of the test, and waiting for what it does."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import redis

from bus.stream_trim import parse_id
from gpu_worker.worker import Worker
from jobs.protocol import ENTRY_FIELD, TOKENS_FIELD, TokenBatch, decode
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


def published_entries(client: redis.Redis, config: BusConfig) -> list[tuple[bytes, dict]]:
    """The token batches the workers published, as tokens-stream entries were read
    (``{m: batch}``), oldest first: from every worker's progress log (field ``t``,
    bus/fenced_stream.py) and the tokens stream (less the empty batches by which a worker
    says it opened its log)."""
    found: list[tuple[tuple[int, int], bytes, dict]] = []
    logs = client.scan_iter(match=config.progress_stream("w")[:-1] + "*", count=1000)
    for log in logs:
        for entry_id, fields in client.xrange(log):
            if TOKENS_FIELD in fields:
                found.append((parse_id(entry_id), entry_id, {ENTRY_FIELD: fields[TOKENS_FIELD]}))
    for entry_id, fields in client.xrange(config.tokens_stream()):
        if decode(fields[ENTRY_FIELD], TokenBatch).items:
            found.append((parse_id(entry_id), entry_id, fields))
    # By id alone: two workers' logs can hold the same id, and their fields do not compare.
    found.sort(key=lambda entry: entry[0])
    return [(entry_id, fields) for _, entry_id, fields in found]
