"""What a stage's turn writes: effects queued on one MULTI with the acknowledgements.

A stage returns outputs (messages to add to streams, keys to set or expire, hash counts) and
the code that commits its turn queues them, with the turn's dead letters, on the MULTI that
acknowledges its inputs: either all of it is written or none is (a replayable stage's, the
detokenizer's, go on a pipeline and are acknowledged with its next read: bus/actor.py). (A
worker's commit queues the same commands on a script call that checks its fence first:
bus/scripted_multi.py.) Executed with `execute_logging_errors`, one command that fails (a
reply stream that is a hash) is dropped without undoing the others; a Redis at ``maxmemory``
refuses the whole MULTI, and that is raised as the transient error it is
(redis.OutOfMemoryError, in REDIS_TRANSIENT): the inputs stay pending, to be handled again
once memory is freed.

The jobs of one commit bound for a job stream (`job_streams`), or for a worker that reads
bundles (`Outbound.bundle`), go in one bundle entry per stream (`add_jobs`, jobs/wire.py):
one XADD per hop and destination for a whole batch, not one per job.

No XADD here trims its stream by a count: a stream read by consumer groups is trimmed by
its consumers below what every group acknowledged (bus/stream_trim.py), and a reply stream
by its reader (bus/replies.py) and its TTL. Only the dead-letter stream, which is for
people, keeps an approximate MAXLEN.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from jobs.protocol import ENTRY_FIELD, Message, encode, job_entries
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


@dataclass
class Outbound:
    """A message to XADD (a stage's usual output)."""

    stream: str
    message: Message
    expire_s: int | None = None  # for reply streams: gone once their reader is long gone
    # False: write only to a stream that exists (XADD NOMKSTREAM); one its reader deleted
    # stays deleted rather than come back without an expiry.
    create: bool = True
    # A job whose reader reads bundle entries (a worker that says so in its heartbeat): one
    # entry with the commit's other jobs for the same stream (`write_outputs`).
    bundle: bool = False

    def apply(self, pipe: Any, config: BusConfig) -> None:
        pipe.xadd(self.stream, {ENTRY_FIELD: encode(self.message)}, nomkstream=not self.create)
        if self.expire_s is not None:
            pipe.expire(self.stream, self.expire_s)


@dataclass
class SetKey:
    """A key set, with a TTL, in the same commit as the outputs."""

    key: str
    value: str | bytes
    ttl_s: int

    def apply(self, pipe: Any, config: BusConfig) -> None:
        pipe.set(self.key, self.value, ex=self.ttl_s)


@dataclass
class ExpireKey:
    """A key's TTL renewed (a reply stream, which outlives the TTL it was set with)."""

    key: str
    ttl_s: int

    def apply(self, pipe: Any, config: BusConfig) -> None:
        pipe.expire(self.key, self.ttl_s)


@dataclass
class IncrHash:
    key: str
    field: str
    by: int = 1

    def apply(self, pipe: Any, config: BusConfig) -> None:
        pipe.hincrby(self.key, self.field, self.by)


Output = Outbound | SetKey | ExpireKey | IncrHash


def reply(config: BusConfig, reply_to: str, message: Message) -> Outbound:
    """A message to a request's reply stream, which expires reply_ttl_s after its last write
    (its reader may be long gone)."""
    return Outbound(reply_to, message, expire_s=config.reply_ttl_s)


def dead_letter_fields(
    source: str, entry_id: bytes | str, reason: str, payload: bytes | None
) -> dict[str, Any]:
    return {
        "source": source,
        "entry_id": entry_id,
        "reason": reason,
        "payload": payload if payload is not None else b"",
        "time": f"{time.time():.3f}",
    }


def write_outputs(pipe: Any, config: BusConfig, outputs: Sequence[Output]) -> None:
    """Queue the commands of `outputs` on a pipeline (the acks' MULTI, or a replayable
    stage's pipeline); the jobs among them for a job stream in one bundle entry per stream,
    in their order."""
    bundled = job_streams(config)
    jobs: dict[str, list[bytes]] = {}
    for out in outputs:
        if isinstance(out, Outbound) and (out.bundle or out.stream in bundled):
            jobs.setdefault(out.stream, []).append(encode(out.message))
        else:
            out.apply(pipe, config)
    for stream, payloads in jobs.items():
        add_jobs(pipe, stream, payloads)


def job_streams(config: BusConfig) -> tuple[str, str]:
    """The two stage hops a job crosses before its worker, whose writers bundle a commit's
    jobs into one entry. (A worker's stream is bundled only for a worker that reads bundles:
    `Outbound.bundle`.)"""
    return config.requests_stream(), config.tokenized_stream()


def add_jobs(pipe: Any, stream: str, payloads: list[bytes]) -> None:
    """Queue the XADDs that put encoded jobs on a job stream: one bundle entry for all (a
    plain entry for one alone; more only past a bundle's bounds)."""
    for fields in job_entries(payloads):
        pipe.xadd(stream, fields)


def write_dead_letters(pipe: Any, config: BusConfig, dead: Sequence[dict[str, Any]]) -> None:
    """Queue dead letters (`dead_letter_fields`) on a pipeline (one MULTI with the acks)."""
    for fields in dead:
        pipe.xadd(config.dead_letter_stream(), fields,
                  maxlen=config.stream_maxlen, approximate=True)  # fmt: skip


def execute_logging_errors(pipe: Any, who: str) -> list[Any]:
    """EXEC without raising on a failed command: one output to a key of the wrong type (a
    client naming a hash as its reply stream) must not undo the rest or kill the stage. The
    other commands of a MULTI are applied either way.

    Raises redis.OutOfMemoryError when Redis is full: a MULTI is then refused whole, and a
    command refused in a plain pipeline must not be dropped as if it were the client's
    fault. The caller's reconnect policy retries; its inputs stay pending meanwhile."""
    results = pipe.execute(raise_on_error=False)
    for result in results:
        if isinstance(result, redis.OutOfMemoryError):
            raise result
        if isinstance(result, redis.ResponseError):
            logger.warning("%s: a write failed and was dropped: %s", who, result)
    return results
