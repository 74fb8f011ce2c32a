"""Which workers are alive: the one reader of the workers set and their heartbeat keys.

A worker adds its id to the workers set (``<p>:workers``) and writes its `Heartbeat` under
its heartbeat key (``<p>:heartbeat:<id>``) every ``heartbeat_interval_s``, with a TTL of
``heartbeat_ttl_s`` (gpu_worker/heartbeat.py). So Redis itself decides staleness: a worker
is **alive** while its key exists, and **lapsed** (dead, or not beating yet) once the key
has expired while its id is still in the set, where it stays until the reaper
(stages/router/worker_reaper.py) has moved its jobs. A live key whose value this version
cannot decode is alive but **malformed**: counted as alive, never handed work, never a crash.

Every reader asks the same two commands, in two round trips: SMEMBERS of the set, then one
MGET of the members' heartbeat keys (no SCAN: the set names every key). The router, which
also needs the jobs each worker was routed (``<p>:routed``), gets that HGETALL in the same
round trip as the MGET. The blocking (`read_liveness`) and asyncio (`read_liveness_async`)
forms share the sans-I/O core below: which keys, and what their values mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
import redis.asyncio as aredis

from jobs.protocol import Heartbeat, ProtocolError, decode
from runtime.config import BusConfig


@dataclass(frozen=True)
class Liveness:
    """The workers as one read saw them; every collection is in worker-id order."""

    registered: tuple[str, ...] = ()  # the ids in the workers set
    beats: dict[str, Heartbeat] = field(default_factory=dict)  # id -> its decoded heartbeat
    malformed: dict[str, str] = field(default_factory=dict)  # id -> why its value is unread
    routed: dict[str, int] = field(default_factory=dict)  # id -> jobs routed (when asked)

    @property
    def alive(self) -> tuple[str, ...]:
        """Ids whose heartbeat key exists, malformed or not."""
        return tuple(i for i in self.registered if i in self.beats or i in self.malformed)

    @property
    def lapsed(self) -> frozenset[str]:
        """Ids in the workers set whose heartbeat key has expired."""
        return frozenset(self.registered) - set(self.alive)


# The sans-I/O core: what to ask, and what the replies mean.


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def worker_ids(members: Iterable[bytes | str]) -> tuple[str, ...]:
    """The workers set's members (SMEMBERS' reply), as sorted ids."""
    return tuple(sorted(_text(member) for member in members))


def _queue_reads(pipe, config: BusConfig, ids: tuple[str, ...], routed: bool) -> None:
    pipe.mget([config.heartbeat_key(worker_id) for worker_id in ids])
    if routed:
        pipe.hgetall(config.routed_key())


def _liveness(ids: tuple[str, ...], replies: list) -> Liveness:
    """The read's answer from the MGET's values (None: the key has expired) and, when asked,
    the routed hash."""
    values, *rest = replies
    beats, malformed = {}, {}
    for worker_id, raw in zip(ids, values, strict=True):
        if raw is None:
            continue  # lapsed
        try:
            beats[worker_id] = decode(raw, Heartbeat)
        except ProtocolError as exc:
            malformed[worker_id] = str(exc)  # not a heartbeat this version reads
    routed = {_text(k): int(v) for k, v in rest[0].items()} if rest else {}
    return Liveness(ids, beats, malformed, routed)


# The two forms: the same commands, blocking or awaited.


def registered_workers(client: redis.Redis, config: BusConfig) -> tuple[str, ...]:
    """The ids in the workers set, alive or lapsed (one SMEMBERS)."""
    return worker_ids(client.smembers(config.workers_key()))


def read_liveness(client: redis.Redis, config: BusConfig, routed: bool = False) -> Liveness:
    """The workers and their heartbeats; with `routed`, the routed hash too."""
    ids = registered_workers(client, config)
    if not ids:
        return Liveness()
    pipe = client.pipeline(transaction=False)
    _queue_reads(pipe, config, ids, routed)
    return _liveness(ids, pipe.execute())


async def read_liveness_async(
    client: aredis.Redis, config: BusConfig, routed: bool = False
) -> Liveness:
    """`read_liveness` on an asyncio client."""
    ids = worker_ids(await client.smembers(config.workers_key()))
    if not ids:
        return Liveness()
    pipe = client.pipeline(transaction=False)
    _queue_reads(pipe, config, ids, routed)
    return _liveness(ids, await pipe.execute())
