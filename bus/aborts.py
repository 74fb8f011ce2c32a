"""Aborting requests: a flag, with the reply stream's TTL, that the worker holding the job reads.

An abort writes the flag (`<p>:abort:<rid>`), and an Abort entry for jobs whose worker the
caller knows (below). A job still on its way to a worker (in the
requests, tokenized or worker streams, or moving off a dead worker) is dropped when a worker
admits it (one MGET per admission, gpu_worker/worker.py); one it holds (running, or waiting
for its grammar) is ended by its worker, which reads its jobs' flags in its commit at most
every `abort_check_interval_ms` (bus/fenced_stream.py ``abort_checks``: one MGET for all its
jobs) and frees it within about that. The job's stream ends with "abort".

Nothing on the bus records which worker a job went to. A route key per job (set by the
router, renewed by the worker, read here to send an Abort to that worker's stream) cost a SET
per request at any rate of aborts, and the checks cost a command per worker per interval at
most, whatever the number of jobs: at a 64-request burst 64 SETs against a few MGETs (issue
27). But the ingress serving a request learns its worker from its first delta (the
detokenizer copies it from the TokenBatch), and when its client leaves it passes `workers`:
each of those jobs also gets an Abort entry on its worker's stream, which the worker reads
with its next jobs, so the common abort frees the job within a step, not an interval. The
entry is written with NOMKSTREAM (a worker gone since has no stream to recreate), and one
worker id a stream entry could have garbled costs only its entry, not the flags.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import redis
import redis.asyncio as aredis

from jobs.protocol import ENTRY_FIELD, Abort, encode
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


Workers = Mapping[str, str]  # rid -> the worker known to run it, told on its stream too


def _queued(client, config: BusConfig, rids: Sequence[str], workers: Workers | None):
    """A pipeline of the flags, then the Abort entries; None when there is nothing to abort."""
    if not rids:
        return None
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        pipe.set(config.abort_key(rid), 1, ex=config.reply_ttl_s)
    for rid, worker_id in (workers or {}).items():
        try:
            stream = config.worker_stream(worker_id)
        except ValueError:  # not a worker id: the flag alone ends the job
            logger.warning("abort of %s: %r is no worker id", rid, worker_id)
            continue
        pipe.xadd(stream, {ENTRY_FIELD: encode(Abort(rid))}, nomkstream=True)
    return pipe


def _check(rids: Sequence[str], results: list) -> None:
    """A flag not written is the abort failing; an entry a worker's stream refused (a key
    of another type under its name) leaves that job to its flag."""
    for result in results[: len(rids)]:
        if isinstance(result, Exception):
            raise result
    for result in results[len(rids) :]:
        if isinstance(result, Exception):
            logger.warning("an abort's entry on a worker stream was refused: %s", result)


def publish_aborts(client: redis.Redis, config: BusConfig, rids: Sequence[str],
                   workers: Workers | None = None) -> None:  # fmt: skip
    """Abort `rids` (and tell `workers`' workers)."""
    if (pipe := _queued(client, config, rids, workers)) is not None:
        _check(rids, pipe.execute(raise_on_error=False))


async def publish_aborts_async(client: aredis.Redis, config: BusConfig, rids: Sequence[str],
                               workers: Workers | None = None) -> None:  # fmt: skip
    """As publish_aborts, awaited."""
    if (pipe := _queued(client, config, rids, workers)) is not None:
        _check(rids, await pipe.execute(raise_on_error=False))


def publish_abort(client: redis.Redis, config: BusConfig, rid: str) -> None:
    publish_aborts(client, config, [rid])


async def publish_abort_async(client: aredis.Redis, config: BusConfig, rid: str) -> None:
    await publish_aborts_async(client, config, [rid])
