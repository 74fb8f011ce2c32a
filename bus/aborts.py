"""Aborting requests: a flag every stage can check, and a message to the worker that runs it.

The abort key is set first and the route read after, both in one pipeline (Redis runs them
in order): if the router has not routed the job yet, the worker finds the key when the job
arrives and drops it; if it has, the route key names the worker, which gets an Abort on its
own stream and frees the request within a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
import redis.asyncio as aredis

from jobs.protocol import ENTRY_FIELD, Abort, encode
from runtime.config import BusConfig


def _flag_and_find(pipe, config: BusConfig, rids: Sequence[str]) -> None:
    for rid in rids:
        pipe.set(config.abort_key(rid), 1, ex=config.reply_ttl_s)
    for rid in rids:
        pipe.get(config.route_key(rid))


def _routed(rids: Sequence[str], results: list) -> list[tuple[str, str]]:
    """(rid, worker id) of the rids a router has routed; `results` are SETs then GETs."""
    routes = results[len(rids) :]
    return [(rid, worker.decode()) for rid, worker in zip(rids, routes, strict=True) if worker]


def _tell_workers(pipe, config: BusConfig, routed: list[tuple[str, str]]) -> None:
    for rid, worker_id in routed:
        pipe.xadd(config.worker_stream(worker_id), {ENTRY_FIELD: encode(Abort(rid))})


def publish_aborts(client: redis.Redis, config: BusConfig, rids: Sequence[str]) -> None:
    if not rids:
        return
    pipe = client.pipeline(transaction=False)
    _flag_and_find(pipe, config, rids)
    routed = _routed(rids, pipe.execute())
    if routed:
        pipe = client.pipeline(transaction=False)
        _tell_workers(pipe, config, routed)
        pipe.execute()


async def publish_aborts_async(
    client: aredis.Redis, config: BusConfig, rids: Sequence[str]
) -> None:
    if not rids:
        return
    pipe = client.pipeline(transaction=False)
    _flag_and_find(pipe, config, rids)
    routed = _routed(rids, await pipe.execute())
    if routed:
        pipe = client.pipeline(transaction=False)
        _tell_workers(pipe, config, routed)
        await pipe.execute()


def publish_abort(client: redis.Redis, config: BusConfig, rid: str) -> None:
    publish_aborts(client, config, [rid])


async def publish_abort_async(client: aredis.Redis, config: BusConfig, rid: str) -> None:
    await publish_aborts_async(client, config, [rid])
