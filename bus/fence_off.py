"""The reader's side of a worker's progress log and fence (bus/fenced_stream.py): the log read
in order, and the reaper's claim of a worker's jobs that closes the log in the same MULTI.

Used by the router's reaper (stages/router/worker_reaper.py), and by a worker reading its
own log for the jobs handed back to it (gpu_worker/publishing.py).
"""

from __future__ import annotations

import logging
import secrets

import redis

from bus.fenced_stream import CLOSED_LOG_ID, WORKER_GROUP, Entry
from bus.reconnect import ensure_group, is_missing_group
from jobs.progress import ProgressEntry
from jobs.protocol import ENTRY_FIELD, ProtocolError, decode
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


def read_progress_log(
    client: redis.Redis, config: BusConfig, worker_id: str
) -> list[ProgressEntry]:
    """Worker `worker_id`'s progress log, oldest first; a malformed entry is skipped (logged)."""
    stream = config.progress_stream(worker_id)
    entries: list[ProgressEntry] = []
    start: bytes | str = "-"
    while True:
        chunk = client.xrange(stream, min=start, count=1000)
        for entry_id, fields in chunk:
            try:
                entries.append(decode((fields or {}).get(ENTRY_FIELD), ProgressEntry))
            except ProtocolError as exc:
                logger.warning("%s: skipping progress entry %s: %s", stream, entry_id, exc)
        if len(chunk) < 1000:
            return entries
        start = b"(" + chunk[-1][0]


def fence_off(
    client: redis.Redis, config: BusConfig, worker_id: str, consumer: str, count: int
) -> tuple[list[Entry], dict[bytes, int]]:
    """The reaper's claim: up to `count` of the worker's pending entries, claimed by
    `consumer` in the MULTI that closes the worker's progress log (its fence:
    `CLOSED_LOG_ID`), else its unread ones, read by an XREADGROUP right after it, so their
    old owner can write nothing more about them (a worker that never opened its log has none
    to close: it has written nothing). Also returns, by entry id, how many times each
    claimed entry had been delivered to a worker (none for unread ones)."""
    stream = config.worker_stream(worker_id)
    try:
        pipe = client.pipeline(transaction=True)
        pipe.execute_command("XSETID", config.progress_stream(worker_id), CLOSED_LOG_ID)
        pipe.set(config.legacy_fence_key(worker_id), secrets.token_hex(8))  # older workers'
        # Before the claim counts itself: the deliveries to workers that died holding them.
        pipe.xpending_range(stream, WORKER_GROUP, "-", "+", count=count)
        pipe.xautoclaim(stream, WORKER_GROUP, consumer, min_idle_time=0, start_id="0-0",
                        count=count)  # fmt: skip
        closed, _, pending, claimed = pipe.execute(raise_on_error=False)
        for result in (pending, claimed):
            if isinstance(result, Exception):
                raise result
        if isinstance(closed, Exception) and client.exists(config.progress_stream(worker_id)):
            raise closed  # not "no such key": a log that is not a stream
        _, entries, _ = claimed
        if entries:
            return entries, {p["message_id"]: p["times_delivered"] for p in pending}
        response = client.xreadgroup(WORKER_GROUP, consumer, {stream: ">"}, count=count)
    except redis.ResponseError as exc:
        if not is_missing_group(exc):
            raise
        # Jobs routed before the worker ever made its group: read them from the start.
        ensure_group(client, stream, WORKER_GROUP)
        return fence_off(client, config, worker_id, consumer, count)
    return (response[0][1] if response else []), {}
