"""Aborting requests: a flag, with the reply stream's TTL, that the worker holding the job reads.

An abort writes only the flag (`<p>:abort:<rid>`). A job still on its way to a worker (in the
requests, tokenized or worker streams, or moving off a dead worker) is dropped when a worker
admits it (one MGET per admission, gpu_worker/worker.py); one it holds (running, or waiting
for its grammar) is ended by its worker, which reads its jobs' flags in its commit at most
every `abort_check_interval_ms` (bus/fenced_stream.py ``abort_checks``: one MGET for all its
jobs) and frees it within about that. The job's stream ends with "abort".

Nothing records which worker a job went to. A route key per job (set by the router, renewed
by the worker, read here to send an Abort to that worker's stream) cost a SET per request at
any rate of aborts, and the checks cost a command per worker per interval at most, whatever
the number of jobs: at a 64-request burst 64 SETs against a few MGETs (issue 27). An Abort
entry on a worker's stream (an older client's) is still obeyed.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
import redis.asyncio as aredis

from runtime.config import BusConfig


def _flag(pipe, config: BusConfig, rids: Sequence[str]) -> None:
    for rid in rids:
        pipe.set(config.abort_key(rid), 1, ex=config.reply_ttl_s)


def publish_aborts(client: redis.Redis, config: BusConfig, rids: Sequence[str]) -> None:
    if not rids:
        return
    pipe = client.pipeline(transaction=False)
    _flag(pipe, config, rids)
    pipe.execute()


async def publish_aborts_async(
    client: aredis.Redis, config: BusConfig, rids: Sequence[str]
) -> None:
    if not rids:
        return
    pipe = client.pipeline(transaction=False)
    _flag(pipe, config, rids)
    await pipe.execute()


def publish_abort(client: redis.Redis, config: BusConfig, rid: str) -> None:
    publish_aborts(client, config, [rid])


async def publish_abort_async(client: aredis.Redis, config: BusConfig, rid: str) -> None:
    await publish_aborts_async(client, config, [rid])
