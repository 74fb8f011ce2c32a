"""What admission and /health ask of Redis: how many workers are alive (and what serves on
each), how long the queue is.

A worker is alive while its heartbeat key exists (it expires ``heartbeat_ttl_s`` after the
last beat). Admission reads the count at most once per ``ttl_s``: every request asking
would cost a round trip for a figure that changes once a second.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aredis

from bus.config import BusConfig
from jobs.protocol import Heartbeat, ProtocolError, decode

WORKERS_CHECK_INTERVAL_S = 1.0


async def count_live_workers(client: aredis.Redis, config: BusConfig) -> int:
    ids = [member.decode() for member in await client.smembers(config.workers_key())]
    if not ids:
        return 0
    pipe = client.pipeline(transaction=False)
    for worker_id in ids:
        pipe.exists(config.heartbeat_key(worker_id))
    return sum(await pipe.execute())


async def serving_paths(client: aredis.Redis, config: BusConfig) -> dict[str, str | None]:
    """Each live worker's attention path, from its heartbeat (None: it does not say)."""
    ids = sorted(member.decode() for member in await client.smembers(config.workers_key()))
    if not ids:
        return {}
    values = await client.mget([config.heartbeat_key(worker_id) for worker_id in ids])
    paths = {}
    for worker_id, value in zip(ids, values, strict=True):
        if value is None:
            continue  # lapsed: not live
        try:
            paths[worker_id] = decode(value, Heartbeat).attention
        except ProtocolError:
            paths[worker_id] = None
    return paths


async def queue_depth(client: aredis.Redis, config: BusConfig) -> int:
    """Jobs waiting for (or held by) the tokenizer and router stages.

    A stream keeps entries after they are acknowledged (until MAXLEN trims them), so its
    XLEN is not its backlog once a group reads it: the group's ``lag`` (never delivered) plus
    ``pending`` (delivered, not yet acknowledged) is. Before any group exists, XLEN is.
    """
    streams = (config.requests_stream(), config.tokenized_stream())
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_groups(stream)
        pipe.xlen(stream)
    results = await pipe.execute(raise_on_error=False)
    depth = 0
    for groups, length in zip(results[::2], results[1::2], strict=True):
        if isinstance(groups, Exception) or isinstance(length, Exception):
            continue  # no such stream yet: nothing queued
        if not groups:
            depth += length
        else:
            depth += max(g["pending"] + (g.get("lag") or 0) for g in groups)
    return depth


class WorkerHealth:
    """The live-worker count, refreshed at most once per `interval_s` (shared by callers)."""

    def __init__(
        self,
        client: aredis.Redis,
        config: BusConfig,
        interval_s: float = WORKERS_CHECK_INTERVAL_S,
    ) -> None:
        self.client = client
        self.config = config
        self.interval_s = interval_s
        self.live = 0
        self._checked_at = -float("inf")
        self._live_at = -float("inf")  # when a check last found a live worker
        self._lock = asyncio.Lock()

    async def live_workers(self, fresh: bool = False) -> int:
        async with self._lock:  # one check at a time; the others get its answer
            if fresh or time.monotonic() - self._checked_at >= self.interval_s:
                self.live = await count_live_workers(self.client, self.config)
                self._checked_at = time.monotonic()
                if self.live:
                    self._live_at = self._checked_at
            return self.live

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
