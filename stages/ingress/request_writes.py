"""The requests' own writes, gathered per turn of the event loop: one round trip, and one
command where Redis takes many keys, for every handler that asks in the same turn.

A request costs the bus, besides its tokens, a MULTI at its start (the SET of its request
key, the XADD of its jobs, EXEC) and a DEL at its end. Under load many handlers ask in one
turn: their starts go in one MULTI (the SETs, and one XADD of a bundle entry per job stream
holding every job of the turn bound there: jobs/wire.py; one MULTI and EXEC for all) and
their ends in one DEL of all their keys (and one pipeline of their aborts). Each request is
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

import redis.asyncio as aredis

from bus.aborts import publish_aborts_async
from bus.effects import add_jobs, reply
from bus.reconnect import REDIS_TRANSIENT
from jobs.protocol import ErrorReply, GenerateRequest, encode
from jobs.request_normaliser import ModelLimits, tokenized_job
from runtime.config import BusConfig

logger = logging.getLogger(__name__)

Start = tuple[str, bytes, Sequence[GenerateRequest], "asyncio.Future[None]"]


class RequestWrites:
    """The starts and ends of the requests on one shard (its client and names); `limits`
    are what this ingress knows of the model (its context length, or nothing)."""

    def __init__(self, client: aredis.Redis, config: BusConfig, limits: ModelLimits) -> None:
        self.client = client
        self.config = config
        self.limits = limits
        self._starts: list[Start] = []
        self._ends: list[tuple[str, list[str], dict[str, str]]] = []
        self._writing: set[asyncio.Task[None]] = set()
        self._msetex: bool | None = None  # whether the server has MSETEX, once asked

    async def start(self, request_id: str, record: bytes,
                    requests: Sequence[GenerateRequest]) -> None:  # fmt: skip
        """Set the request's key to `record` and queue its jobs, in the next MULTI; raises
        what that MULTI raised."""
        done = asyncio.get_running_loop().create_future()
        self._starts.append((request_id, record, requests, done))
        if len(self._starts) == 1:
            asyncio.get_running_loop().call_soon(self._write, self._start_all)
        await done

    def end(self, request_id: str, unfinished: list[str], workers: dict[str, str]) -> None:
        """Delete the request's key and abort its `unfinished` sub-requests, with the next
        ends (an error is logged: the key expires, as an abort's flag would)."""
        self._ends.append((request_id, unfinished, workers))
        if len(self._ends) == 1:
            asyncio.get_running_loop().call_soon(self._write, self._end_all)

    async def drain(self, timeout_s: float) -> None:
        """Let the writes under way reach Redis (shutdown)."""
        await asyncio.sleep(0)  # the turn that queued the last ones has scheduled them
        if self._writing:
            await asyncio.wait(list(self._writing), timeout=timeout_s)

    def _write(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work())
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    async def _start_all(self) -> None:
        starts, self._starts = self._starts, []
        records = {self.config.request_key(r): record for r, record, _, _ in starts}
        jobs = [job for _, _, requests, _ in starts for job in requests]
        try:
            if self._msetex is None:
                self._msetex = await has_msetex(self.client)
            try:
                await self._write_starts(records, jobs, self._msetex)
            except aredis.ResponseError as exc:
                if not self._msetex or "MSETEX" not in str(exc).upper():
                    raise
                self._msetex = False  # a server swapped for an older one: SETs from now on
                await self._write_starts(records, jobs, False)
        except BaseException as exc:  # every request of the MULTI failed, each says so
            for *_, done in starts:
                if done.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    done.cancel()  # shutdown: queued or not, their handlers abort them
                else:
                    done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for *_, done in starts:
            if not done.done():  # its handler may have been cancelled meanwhile
                done.set_result(None)

    async def _write_starts(self, records: dict[str, bytes], jobs: list[GenerateRequest],
                            msetex: bool) -> None:  # fmt: skip
        pipe = self.client.pipeline(transaction=True)
        ttl_s = self.config.reply_ttl_s
        if msetex and len(records) > 1:
            flat = [part for key_value in records.items() for part in key_value]
            pipe.execute_command("MSETEX", len(records), *flat, "EX", ttl_s)
        else:
            for key, record in records.items():
                pipe.set(key, record, ex=ttl_s)
        queue_jobs(pipe, self.config, self.limits, jobs)
        await pipe.execute()

    async def _end_all(self) -> None:
        ends, self._ends = self._ends, []
        aborted = [rid for _, unfinished, _ in ends for rid in unfinished]
        workers = {rid: worker for *_, known in ends for rid, worker in known.items()}
        try:
            await self.client.delete(*(self.config.request_key(r) for r, *_ in ends))
            if aborted:
                await publish_aborts_async(self.client, self.config, aborted, workers)
                logger.debug("aborted %s", aborted)
        except REDIS_TRANSIENT as exc:
            logger.warning("could not end %d requests (%d aborts): %s",
                           len(ends), len(aborted), exc)  # fmt: skip


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
