"""Aborting requests: a flag, with the reply stream's TTL, and an entry on the shard's aborts
stream, which the worker holding the job reads.

An abort writes the flag (`<p>:abort:<rid>`), one entry naming its rids on `<p>:aborts`
(`aborts_stream`, capped at about `ABORTS_MAXLEN` entries), and an Abort entry for jobs
whose worker the caller knows (below). A job still on its way to a worker (in the
requests, tokenized or worker streams, or moving off a dead worker) is dropped when a worker
admits it (one MGET of the flags per admission, gpu_worker/job_admission.py); one it holds
(running, or waiting for its grammar) is ended by its worker, which reads the aborts
stream from where it last read it in its commit, at most every `abort_check_interval_ms`
(bus/fenced_stream.py ``abort_checks``), and frees it within about that. The job's stream
ends with "abort". Reading the stream costs the worker one small command however many jobs
it holds; the MGET of every held job's flag it replaces sent every one of their key names
to Redis each interval, 1.5 bytes into Redis per generated token on a 64-request burst
(issue 27). A worker that falls more than `ABORTS_MAXLEN` entries behind misses the
trimmed ones: its jobs then run to their end, the flags still drop their retries. Writers
of aborts (ingresses, clients) go before workers in a rolling upgrade.

Nothing on the bus records which worker a job went to. A route key per job (set by the
router, renewed by the worker, read here to send an Abort to that worker's stream) cost a SET
per request at any rate of aborts (issue 27). But the ingress serving a request learns its
worker from its first delta (the detokenizer copies it from the TokenBatch), and when its
client leaves it passes `workers`: each of those jobs also gets an Abort entry on its
worker's stream, which the worker reads with its next jobs, so the common abort frees the
job within a step, not an interval. The entry is written with NOMKSTREAM (a worker gone
since has no stream to recreate), and one worker id a stream entry could have garbled costs
only its entry, not the flags.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import msgpack
import redis
import redis.asyncio as aredis

from jobs.protocol import ENTRY_FIELD, Abort, encode
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


Workers = Mapping[str, str]  # rid -> the worker known to run it, told on its stream too

ABORTS_MAXLEN = 10_000  # entries kept on an aborts stream: 500 ms of a worker's lag is few
RIDS_FIELD = "rids"  # an aborts-stream entry's field: the msgpack list of the aborted rids


def aborts_stream(config: BusConfig) -> str:
    """The stream every abort of the shard is written to, and its workers read."""
    return config.key_name("aborts")


def aborted_rids(entries: list) -> set[str]:
    """The rids the aborts-stream `entries` (id, fields) name; a malformed entry is skipped
    (anyone can write to Redis: nothing read here may end a worker)."""
    rids: set[str] = set()
    for entry_id, fields in entries:
        try:
            named = msgpack.unpackb((fields or {})[RIDS_FIELD.encode()])
            if not isinstance(named, list) or not all(isinstance(r, str) for r in named):
                raise ValueError("not a list of rids")
        except Exception as exc:  # a bad entry is skipped, whatever it is
            logger.warning("skipping aborts entry %s: %s", entry_id, exc)
            continue
        rids.update(named)
    return rids


def _queued(client, config: BusConfig, rids: Sequence[str], workers: Workers | None):
    """A pipeline of the flags, then the Abort entries; None when there is nothing to abort."""
    if not rids:
        return None
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        pipe.set(config.abort_key(rid), 1, ex=config.reply_ttl_s)
    pipe.xadd(aborts_stream(config), {RIDS_FIELD: msgpack.packb(list(rids))},
              maxlen=ABORTS_MAXLEN, approximate=True)  # fmt: skip
    for rid, worker_id in (workers or {}).items():
        try:
            stream = config.worker_stream(worker_id)
        except ValueError:  # not a worker id: the flag alone ends the job
            logger.warning("abort of %s: %r is no worker id", rid, worker_id)
            continue
        pipe.xadd(stream, {ENTRY_FIELD: encode(Abort(rid))}, nomkstream=True)
    return pipe


def _check(rids: Sequence[str], results: list) -> None:
    """A flag or the aborts-stream entry not written is the abort failing; an entry a
    worker's stream refused (a key of another type under its name) leaves that job to its
    flag and the aborts stream."""
    for result in results[: len(rids) + 1]:
        if isinstance(result, Exception):
            raise result
    for result in results[len(rids) + 1 :]:
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
