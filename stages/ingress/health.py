"""What admission and /health ask of Redis: how many workers are alive (and what serves on
each), how long the queue is.

A worker is alive while its heartbeat key exists (it expires ``heartbeat_ttl_s`` after the
last beat), as bus/liveness.py reads it. Admission reads the workers at most once per
``interval_s``: every request asking would cost a round trip for a figure that changes once
a second. /health reads them fresh, once, for both its count and its attention paths. The
queue's depth is read at most every `QUEUE_CHECK_INTERVAL_S` (three commands a job stream,
which every request would pay else), adding what this replica queued since: a bound that lags
the other replicas by that much.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.connection import Connection

from bus.async_pool import round_trip
from bus.effects import job_streams
from bus.liveness import Liveness, read_liveness_async
from jobs.wire import ProtocolError, job_payloads
from runtime.config import BusConfig

WORKERS_CHECK_INTERVAL_S = 1.0
QUEUE_CHECK_INTERVAL_S = 0.25


def serving_paths(liveness: Liveness) -> dict[str, str | None]:
    """Each live worker's attention path, from its heartbeat (None: it does not say, or its
    heartbeat is malformed)."""
    return {
        worker_id: beat.attention if (beat := liveness.beats.get(worker_id)) else None
        for worker_id in liveness.alive
    }


async def queue_depth(connection: Connection, config: BusConfig) -> int:
    """Jobs waiting for (or held by) the tokenizer and router stages.

    A stream keeps entries after they are acknowledged (until bus/stream_trim.py trims below
    what every group acknowledged), so its XLEN is not its backlog once a group reads it:
    the group's ``lag`` (never delivered) plus ``pending`` (delivered, not yet acknowledged)
    is. Before any group exists, XLEN is.

    Those count entries, and a bundle entry (jobs/wire.py) holds a commit's jobs: one ingress
    turn's, one tokenizer batch's. So each stream's backlog counts as many jobs a piece as
    its newest entry holds: an estimate (bundles grow and shrink with the load), but of the
    right size, where entries alone let ``max_queue`` admit many times its jobs.

    Read in one round trip on `connection` (one kept for these reads: `QueueDepth`'s), the
    replies as the server gives them: redis-py's pipeline and reply parsing were half of the
    read's CPU (210 -> 120 us).
    """
    commands = [
        command
        for stream in job_streams(config)  # the streams whose entries may bundle jobs
        for command in (
            ("XINFO", "GROUPS", stream),
            ("XLEN", stream),
            ("XREVRANGE", stream, "+", "-", "COUNT", 1),
        )  # fmt: skip
    ]
    results = await round_trip(connection, commands)
    depth = 0
    for groups, length, newest in zip(results[::3], results[1::3], results[2::3], strict=True):
        if isinstance(groups, Exception) or isinstance(length, Exception):
            continue  # no such stream yet: nothing queued
        entries = length if not groups else max(_backlog(group) for group in groups)
        depth += entries * _jobs_per_entry(newest)
    return depth


def _as_map(reply: Any) -> dict:
    """A map reply as RESP3 gives it, or as RESP2's flat list of keys and values."""
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))


def _backlog(group: Any) -> int:
    """One XINFO GROUPS row's entries not yet acknowledged: its pending and its lag (None
    where the server cannot tell)."""
    row = _as_map(group)
    return row[b"pending"] + (row.get(b"lag") or 0)


def _jobs_per_entry(newest: Any) -> int:
    """How many jobs the stream's newest entry holds (1 for a plain or unreadable one)."""
    if isinstance(newest, Exception) or not newest:
        return 1
    try:
        return max(1, len(job_payloads(_as_map(newest[0][1] or {}))))
    except ProtocolError:
        return 1


class QueueDepth:
    """`queue_depth`, read at most once per `interval_s` (shared by callers), plus the jobs
    this replica queued since that read."""

    def __init__(
        self, client: aredis.Redis, config: BusConfig, interval_s: float = QUEUE_CHECK_INTERVAL_S
    ) -> None:
        self.client = client
        self.config = config
        self.interval_s = interval_s
        self._depth = 0
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()
        self._connection: Connection | None = None  # kept for these reads

    async def depth(self) -> int:
        if time.monotonic() - self._read_at < self.interval_s:
            return self._depth  # read lately: no lock to take (most calls, under load)
        async with self._lock:
            if time.monotonic() - self._read_at >= self.interval_s:
                if self._connection is None:
                    self._connection = await self.client.connection_pool.get_connection()
                self._depth = await queue_depth(self._connection, self.config)
                self._read_at = time.monotonic()
            return self._depth

    def queued(self, jobs: int) -> None:
        """This replica queued `jobs` more since the last read."""
        self._depth += jobs


class WorkerHealth:
    """The live workers (bus/liveness.py), read at most once per `interval_s` (shared by
    callers)."""

    def __init__(
        self,
        client: aredis.Redis,
        config: BusConfig,
        interval_s: float = WORKERS_CHECK_INTERVAL_S,
    ) -> None:
        self.client = client
        self.config = config
        self.interval_s = interval_s
        self._liveness = Liveness()
        self._checked_at = -float("inf")
        self._live_at = -float("inf")  # when a check last found a live worker
        self._lock = asyncio.Lock()

    async def liveness(self, fresh: bool = False) -> Liveness:
        """The workers as the last read saw them, read again if `fresh` or older than
        `interval_s`."""
        if not fresh and time.monotonic() - self._checked_at < self.interval_s:
            return self._liveness  # read lately: no lock to take (most calls, under load)
        async with self._lock:  # one read at a time; the others get its answer
            if fresh or time.monotonic() - self._checked_at >= self.interval_s:
                self._liveness = await read_liveness_async(self.client, self.config)
                self._checked_at = time.monotonic()
                if self._liveness.alive:
                    self._live_at = self._checked_at
            return self._liveness

    async def live_workers(self, fresh: bool = False) -> int:
        """How many workers have a heartbeat key (`liveness`' caching)."""
        return len((await self.liveness(fresh)).alive)

    async def may_serve(self) -> bool:
        """A live worker now, or one seen within a heartbeat TTL. A gap shorter than that
        is a late beat (a paused or overloaded host), not a dead fleet: the router holds
        jobs until a worker is live again, and fails them after no_worker_timeout_s."""
        if await self.live_workers():
            return True
        # A cached zero may predate a worker's first beat (another caller checked while the
        # fleet was starting): refuse only on a fresh look.
        if await self.live_workers(fresh=True):
            return True
        return time.monotonic() - self._live_at < self.config.heartbeat_ttl_s
