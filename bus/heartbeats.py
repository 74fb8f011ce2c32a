"""The workers' heartbeats as they stand in Redis: the live ones, decoded."""

from __future__ import annotations

import redis

from bus.config import BusConfig
from jobs.protocol import Heartbeat, ProtocolError, decode


def read_heartbeats(client: redis.Redis, config: BusConfig) -> list[Heartbeat]:
    """The heartbeat of each registered worker whose key has not expired, by worker id."""
    ids = sorted(w.decode() if isinstance(w, bytes) else w
                 for w in client.smembers(config.workers_key()))  # fmt: skip
    if not ids:
        return []
    beats = []
    for raw in client.mget([config.heartbeat_key(worker_id) for worker_id in ids]):
        if raw is None:
            continue  # lapsed: dead, or not beating yet
        try:
            beats.append(decode(raw, Heartbeat))
        except ProtocolError:
            continue  # not a heartbeat this version reads
    return beats
