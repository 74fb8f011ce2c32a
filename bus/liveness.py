"""Which workers are alive: the shared reader of the workers set and their heartbeat keys
(runtime/cluster.py's shard choice and the reaper check single keys themselves).

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

A reader that reads on every batch (the router) may keep the set itself in a
`RegisteredWorkers`: the members change when a worker starts or is reaped, the heartbeats
(the MGET, still read every time) say which are alive now. Its SMEMBERS was one command and
one round trip of a router's ~7 a batch, and its reply grows with the fleet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
import redis.asyncio as aredis

from jobs.protocol import Heartbeat, ProtocolError, decode
from runtime.config import BusConfig
from runtime.key_ids import is_valid_id


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
    """The workers set's members (SMEMBERS' reply), as sorted ids. A member that could not
    be a worker's id (not UTF-8, empty, a ':' or a space: no key can be named by it) is left
    out, not a reader's crash: one such member crash-looped every detokenizer, which reads
    every registered worker's log."""
    ids = []
    for member in members:
        try:
            text = _text(member)
        except UnicodeDecodeError:
            continue
        if is_valid_id(text):
            ids.append(text)
    return tuple(sorted(ids))


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
    return Liveness(ids, beats, malformed, _routed_counts(rest[0]) if rest else {})


def _routed_counts(fields: dict) -> dict[str, int]:
    """The routed hash as counts: a field or value no router wrote (not UTF-8, not an
    integer) is left out, as if that worker had been routed nothing."""
    routed = {}
    for worker_id, count in fields.items():
        try:
            routed[_text(worker_id)] = int(count)
        except (UnicodeDecodeError, ValueError):
            continue
    return routed


# The two forms: the same commands, blocking or awaited.


def registered_workers(client: redis.Redis, config: BusConfig) -> tuple[str, ...]:
    """The ids in the workers set, alive or lapsed (one SMEMBERS)."""
    return worker_ids(client.smembers(config.workers_key()))


# A worker that starts beside live ones gets work this much later at most; one that starts
# when none of the known ones is alive, at once (`read_liveness` reads the set again then).
REGISTERED_MAX_AGE_S = 1.0


class RegisteredWorkers:
    """The workers set as a frequent reader keeps it: read again once `max_age_s` old, and
    never kept empty (so the first worker to start is seen at once)."""

    def __init__(self, max_age_s: float = REGISTERED_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._ids: tuple[str, ...] = ()
        self._read_at = float("-inf")

    def ids(self, client: redis.Redis, config: BusConfig) -> tuple[str, ...]:
        if not self.fresh():
            self._ids, self._read_at = registered_workers(client, config), time.monotonic()
        return self._ids

    def fresh(self) -> bool:
        """Whether `ids` would answer without a read."""
        return bool(self._ids) and time.monotonic() - self._read_at < self.max_age_s

    def forget(self) -> None:
        self._ids = ()


def read_liveness(
    client: redis.Redis, config: BusConfig, routed: bool = False,
    registered: RegisteredWorkers | None = None,
) -> Liveness:  # fmt: skip
    """The workers and their heartbeats; with `routed`, the routed hash too. With
    `registered`, the set as it keeps it; read again if none of those is alive."""
    kept = registered is not None and registered.fresh()
    ids = registered.ids(client, config) if registered else registered_workers(client, config)
    if not ids:
        return Liveness()
    pipe = client.pipeline(transaction=False)
    _queue_reads(pipe, config, ids, routed)
    liveness = _liveness(ids, pipe.execute())
    if kept and not liveness.alive:
        assert registered is not None
        registered.forget()  # they lapsed: a worker started since is what there is
        return read_liveness(client, config, routed, registered)
    return liveness


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
