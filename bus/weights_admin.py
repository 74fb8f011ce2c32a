"""Setting the fleet's weights record and reading how far the fleet has got (jobs/weights.py):
what ``POST/GET /admin/weights`` (asyncio) and ``streamserve weights`` (blocking) do.

On a Redis Cluster each shard runs a fleet of its own, and each holds the record: the serial
comes from the first shard given (the home shard), and the same record is written to every
shard, so a version names the same weights everywhere.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aredis

from bus.liveness import read_liveness, read_liveness_async
from jobs.weights import WeightsRecord, fleet_view, new_record, weights_key
from runtime.config import BusConfig


def set_weights(shards: list[tuple[redis.Redis, BusConfig]], source: str) -> WeightsRecord:
    """Ask every worker of every shard to serve `source`; the record written."""
    client, config = shards[0]
    record = new_record(client.hincrby(weights_key(config), "serial", 1), source)
    for client, config in shards:
        client.hset(weights_key(config), mapping=record.to_mapping())
    return record


async def set_weights_async(
    shards: list[tuple[aredis.Redis, BusConfig]], source: str
) -> WeightsRecord:
    """`set_weights` on asyncio clients."""
    client, config = shards[0]
    record = new_record(await client.hincrby(weights_key(config), "serial", 1), source)
    for client, config in shards:
        await client.hset(weights_key(config), mapping=record.to_mapping())
    return record


def read_fleet(shards: list[tuple[redis.Redis, BusConfig]]) -> dict[str, Any]:
    """The version asked for and each live worker's (jobs/weights.py's `fleet_view`)."""
    client, config = shards[0]
    record = _record(client.hgetall(weights_key(config)))
    beats = [beat for c, cfg in shards for beat in read_liveness(c, cfg).beats.values()]
    return fleet_view(record, beats)


async def read_fleet_async(shards: list[tuple[aredis.Redis, BusConfig]]) -> dict[str, Any]:
    """`read_fleet` on asyncio clients."""
    client, config = shards[0]
    record = _record(await client.hgetall(weights_key(config)))
    beats = []
    for c, cfg in shards:
        beats.extend((await read_liveness_async(c, cfg)).beats.values())
    return fleet_view(record, beats)


def _record(raw: dict) -> WeightsRecord | None:
    try:
        return WeightsRecord.from_mapping(raw)
    except ValueError:  # written by hand: the workers report it; show none asked for
        return None
