"""The requests' own writes, gathered per turn of the event loop: one round trip, and one
command where Redis takes many keys, for every handler that asks in the same turn (or while
the shard's previous round trip was under way: one at a time, on a connection of its own).

A request costs the bus, besides its tokens, a MULTI at its start (the SET of its request
key, the XADD of its jobs, EXEC) and a DEL at its end. Under load many handlers ask in one
turn: their starts go in one MULTI (the SETs, and one XADD of a bundle entry per job stream
holding every job of the turn bound there: jobs/wire.py; one MULTI and EXEC for all) and
their ends in one DEL of all their keys after that MULTI's EXEC (and one pipeline of their
aborts). Each request is
still all or none: a MULTI that Redis refuses (OOM) fails every request in it, each
answering its own 503, and none of them is queued. Where the server has MSETEX (Valkey 9.1,
Redis 8.4) the turn's request keys go in one command with their expiry, not one SET each
(a third of a request's own commands under load); elsewhere, and on a server that turns
out to lack it, in SETs.

A job whose prompt is token ids needs no tokenizer: it is checked here as the tokenizer
stage checks it (`tokenized_job`: ids, and their fit in the context where this ingress
knows the context length, runtime/context_length.py) and goes in the MULTI straight to the
router's stream as the TokenizedRequest that stage would have written, or, refused, as the
ErrorReply it would have written to the job's reply stream; so the client gets the same
answer, and the prompt crosses the bus once less (issue 27). A text or chat job goes to the
tokenizer's stream. Where the context length is not known here, the worker refuses a prompt
past its context with that same reply (it checks everything again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.connection import Connection

from bus.aborts import publish_aborts_async
from bus.async_pool import round_trip
from bus.effects import add_jobs, reply
from bus.reconnect import REDIS_TRANSIENT
from jobs.protocol import ErrorReply, GenerateRequest, encode
from jobs.request_normaliser import ModelLimits, tokenized_job
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


class RequestWrites:
    """The starts and ends of the requests on one shard (its client and names); `limits`
    are what this ingress knows of the model (its context length, or nothing).

    One round trip at a time, on a connection of its own: what handlers ask while one is
    under way goes in the next, a turn's starts in its MULTI and its ends' DEL after the
    EXEC. The commands are built by a redis-py pipeline but sent and read on the connection
    itself: the pipeline's execute, and the pool around it, cost ~50 us a round trip, a
    tenth of a request's CPU in the ingress (bench_bus_load at 128 tokens a request)."""

    def __init__(self, client: aredis.Redis, config: BusConfig, limits: ModelLimits) -> None:
        self.client = client
        self.config = config
        self.limits = limits
        self._starts: list[Start] = []
        self._ends: list[End] = []
        self._writer: asyncio.Task[None] | None = None
        self._connection: Connection | None = None
        self._msetex: bool | None = None  # whether the server has MSETEX, once asked

    async def start(self, request_id: str, record: bytes,
                    requests: Sequence[GenerateRequest]) -> None:  # fmt: skip
        """Set the request's key to `record` and queue its jobs, in the next MULTI; raises
        what that MULTI raised."""
        done = asyncio.get_running_loop().create_future()
        self._starts.append((request_id, record, requests, done))
        self._wake()
        await done

    def end(self, request_id: str, unfinished: list[str], workers: dict[str, str]) -> None:
        """Delete the request's key and abort its `unfinished` sub-requests, with the next
        ends (an error is logged: the key expires, as an abort's flag would)."""
        self._ends.append((request_id, unfinished, workers))
        self._wake()

    async def drain(self, timeout_s: float) -> None:
        """Let the writes under way reach Redis (shutdown)."""
        if self._writer is not None:
            await asyncio.wait([self._writer], timeout=timeout_s)

    def _wake(self) -> None:
        if self._writer is None:
            # From the next turn, so that every handler asking in this one goes in it.
            self._writer = asyncio.get_running_loop().create_task(self._write_all())

    async def _write_all(self) -> None:
        try:
            while self._starts or self._ends:
                starts, self._starts = self._starts, []
                ends, self._ends = self._ends, []
                try:
                    await self._round_trip(starts, ends)
                except BaseException as exc:
                    _fail(starts, exc)
                    if not isinstance(exc, Exception):
                        raise
                    if ends:
                        logger.warning("could not end %d requests: %s", len(ends), exc)
        finally:
            self._writer = None
            if self._starts or self._ends:  # cancelled (shutdown): theirs fail too
                starts, self._starts, self._ends = self._starts, [], []
                _fail(starts, asyncio.CancelledError())

    async def _round_trip(self, starts: list[Start], ends: list[End]) -> None:
        if self._msetex is None and starts:
            self._msetex = await has_msetex(self.client)
        commands, exec_at = self._commands(starts, ends)
        replies = await self._send(commands)
        if starts:
            error = _transaction_error(replies[: exec_at + 1])
            if error is not None and self._msetex and "MSETEX" in str(error).upper():
                self._msetex = False  # a server swapped for an older one: SETs from now on
                self._starts[:0] = starts  # the refused MULTI wrote none: again, first
                starts = []
            elif error is not None:
                _fail(starts, error)
            for *_, done in starts:
                if not done.done():  # its handler may have been cancelled meanwhile
                    done.set_result(None)
        if ends and isinstance(replies[-1], redis.ResponseError):
            logger.warning("could not end %d requests: %s", len(ends), replies[-1])
        aborted = [rid for _, unfinished, _ in ends for rid in unfinished]
        if aborted:
            workers = {rid: worker for *_, known in ends for rid, worker in known.items()}
            try:
                await publish_aborts_async(self.client, self.config, aborted, workers)
                logger.debug("aborted %s", aborted)
            except REDIS_TRANSIENT as exc:
                logger.warning("could not abort %d requests: %s", len(aborted), exc)

    def _commands(self, starts: list[Start], ends: list[End]) -> tuple[list[tuple], int]:
        """The round trip's commands, and the index of its EXEC (-1: no starts)."""
        commands: list[tuple] = []
        if starts:
            pipe = self.client.pipeline(transaction=True)  # only builds the commands
            records = {self.config.request_key(r): record for r, record, _, _ in starts}
            jobs = [job for _, _, requests, _ in starts for job in requests]
            ttl_s = self.config.reply_ttl_s
            if self._msetex and len(records) > 1:
                flat = [part for key_value in records.items() for part in key_value]
                pipe.execute_command("MSETEX", len(records), *flat, "EX", ttl_s)
            else:
                for key, record in records.items():
                    pipe.set(key, record, ex=ttl_s)
            queue_jobs(pipe, self.config, self.limits, jobs)
            commands = [("MULTI",), *(args for args, _ in pipe.command_stack), ("EXEC",)]
        exec_at = len(commands) - 1
        if ends:
            commands.append(("DEL", *(self.config.request_key(r) for r, *_ in ends)))
        return commands, exec_at

    async def _send(self, commands: list[tuple]) -> list[Any]:
        if self._connection is None:
            self._connection = await self.client.connection_pool.get_connection()
        return await round_trip(self._connection, commands)


Start = tuple[str, bytes, Sequence[GenerateRequest], "asyncio.Future[None]"]
End = tuple[str, list[str], dict[str, str]]


def _fail(starts: list[Start], exc: BaseException) -> None:
    """Every request of a MULTI that failed says so (a cancelled one: its handler aborts
    it, queued or not)."""
    for *_, done in starts:
        if done.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            done.cancel()
        else:
            done.set_exception(exc)


def _transaction_error(replies: list[Any]) -> Exception | None:
    """What refused a MULTI (a command refused as it was queued, e.g. OOM or unknown;
    the EXEC's abort), or a command of it that failed: the first; None if all went in."""
    for queued in replies[1:-1]:
        if isinstance(queued, Exception):
            return queued
    result = replies[-1]
    if isinstance(result, Exception):
        return result
    return next((r for r in result or () if isinstance(r, Exception)), None)


def queue_jobs(
    pipe: aredis.client.Pipeline, config: BusConfig, limits: ModelLimits,
    jobs: Sequence[GenerateRequest],
) -> None:  # fmt: skip
    """Queue `jobs` on `pipe`: a prompt of token ids checked and bound for the router (or
    its refusal for its reply stream), the others for the tokenizer; one bundle entry per
    job stream (the module docstring says why)."""
    to_tokenize: list[bytes] = []
    to_route: list[bytes] = []
    for job in jobs:
        if job.input_ids is None:
            to_tokenize.append(encode(job))
            continue
        checked = tokenized_job(job, job.input_ids, "input_ids", limits)
        if isinstance(checked, ErrorReply):
            reply(config, job.reply_to, checked).apply(pipe, config)
        else:
            to_route.append(encode(checked))
    add_jobs(pipe, config.requests_stream(), to_tokenize)
    add_jobs(pipe, config.tokenized_stream(), to_route)


async def has_msetex(client: aredis.Redis) -> bool:
    """Whether the server knows MSETEX (COMMAND GETKEYS refuses an unknown command)."""
    try:
        await client.command_getkeys("MSETEX", 1, "k", "v", "EX", 1)
    except aredis.ResponseError:
        return False
    return True
