"""Background responses: run in a task of the replica that took them, and taken over by
another replica when that one dies.

A background response's job is resumable, as a stream's is: its replies land on its
replica's reply stream, and the store keeps that replica as its runner, with its create body
(store.py). Every replica's keeper looks, once a second, at the background responses still
running; one whose runner's liveness key is gone (streaming/resume.py: it expires seconds
after the replica dies) is taken by the first replica to claim it in the store. If its job
was submitted (its request key is there), the new runner reads the rest of its replies from
the dead replica's stream (resume.py), else it submits the job again; either way the
response is answered once, by one runner. A job refused for a full queue or no live worker
waits and tries again, as a batch line does. On SIGTERM a replica's tasks stop without
aborting their jobs, which run on for the replica taking them over; a task stopped any
other way (its response deleted) aborts its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging

import redis
from aiohttp import web

from bus.reconnect import REDIS_TRANSIENT
from jobs.errors import RequestError
from runtime.key_ids import is_valid_id
from runtime.task_cancel import cancel_and_wait
from stages.ingress.batches.runner import RETRY_S
from stages.ingress.errors import ApiError
from stages.ingress.responses import resume
from stages.ingress.responses.output import ResponseBuilder, error_object
from stages.ingress.responses.request import parse_responses
from stages.ingress.responses.store import RUNNING, ResponseStore, StreamOrigin
from stages.ingress.responses.turn import Turn
from stages.ingress.state import STATE, IngressState

logger = logging.getLogger(__name__)

# This replica's background responses: id -> the task running it.
TASKS = web.AppKey("streamserve_background_responses", dict)
KEEPER = web.AppKey("streamserve_background_keeper", asyncio.Task)
KEEPER_POLL_S = 1.0
# How long a response cut short (its replica stopping, its stream's client gone) may take to
# be marked so in the store.
STOP_SAVE_S = 2.0


def run(app: web.Application, turn: Turn) -> None:
    """Run `turn` in a task of this replica."""
    tasks = app[TASKS]
    response_id = turn.response["id"]
    task = asyncio.get_running_loop().create_task(_run(turn))
    tasks[response_id] = task
    task.add_done_callback(lambda _: tasks.pop(response_id, None))


async def _run(turn: Turn) -> None:
    try:
        await _until_admitted(turn)
    except ApiError as exc:  # refused before its first reply: a prompt past the context
        await _fail(turn, exc)
    except asyncio.CancelledError:
        if turn.state.draining:
            raise  # its job runs on, for the replica taking it over
        if turn.builder.response["status"] in RUNNING:  # not cancelled by its user: stopped
            stopped = ApiError(503, "the ingress replica running it stopped", "server_error")
            with contextlib.suppress(redis.RedisError, TimeoutError):
                await asyncio.wait_for(_fail(turn, stopped), STOP_SAVE_S)
        raise
    except Exception:
        logger.exception("background response %s failed", turn.response["id"])
        await _fail(turn, ApiError(500, "internal error", "server_error"))


async def _until_admitted(turn: Turn) -> None:
    """Run the turn; a 429 or 503 before its job's first reply (a full queue, its tenant's
    limits, no live worker) is waited out, as a batch line's is, until the response is
    cancelled or deleted. Nothing of a refused job is left running (its id is used again)."""
    for attempt in itertools.count():
        try:
            async with contextlib.aclosing(turn.events()) as events:
                async for _ in events:
                    pass
            return
        except ApiError as exc:
            if exc.status not in (429, 503):
                raise
        await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
        assert turn.store is not None  # a background response is stored
        try:
            status = (await turn.store.get(turn.response["id"]))["status"]
        except RequestError:
            return  # deleted meanwhile
        if status not in RUNNING:
            return  # cancelled meanwhile


async def _fail(turn: Turn, error: ApiError) -> None:
    turn.builder.failed(error)
    await turn.save()


def stop(app: web.Application, response_id: str) -> bool:
    """Stop this replica's task of `response_id` (its job aborted); whether it had one."""
    task = app[TASKS].get(response_id)
    if task is not None:
        task.cancel()
    return task is not None


async def _keep(app: web.Application) -> None:
    """Take over, once a second, the background responses whose runner died."""
    state = app[STATE]
    store = ResponseStore(state.shards.home.redis, state.shards.home.config, None)
    while True:
        try:
            for orphan in await _orphans(state, store, app[TASKS]):
                try:
                    await _take_over(app, state, store, orphan)
                except REDIS_TRANSIENT:
                    raise
                except Exception:  # the others are still taken over: one must not stop them
                    logger.exception("background response %s: a takeover failed", orphan[0])
        except REDIS_TRANSIENT as exc:
            logger.warning("background responses: Redis unreachable: %s", exc)
        except Exception:  # the next pass tries again; the keeper must not end
            logger.exception("background responses: a pass failed")
        await asyncio.sleep(KEEPER_POLL_S)


async def _orphans(state: IngressState, store: ResponseStore, mine: dict) -> list[tuple[str, str]]:
    """The running background responses whose runner is gone, as (id, that runner). An
    entry of the index whose response is gone, ended or unreadable (an id or a runner no
    replica wrote: not UTF-8, or no replica's name) leaves it."""
    orphans = []
    for member in await store.client.smembers(store.background_index):
        response_id = _text(member)
        if response_id is not None and response_id in mine:
            continue
        fields = [None, None] if response_id is None else await store.client.hmget(
            store.key(response_id), ["runner", "status"])  # fmt: skip
        name, status = (_text(field) for field in fields)
        if name is None or status not in RUNNING or not is_valid_id(name):
            await store.client.srem(store.background_index, member)
            continue
        alive = await state.shards.read(lambda config, name=name: config.frontend_key(name))
        if alive is None:
            orphans.append((response_id, name))
    return orphans


def _text(value: bytes | None) -> str | None:
    """A stored value as text; None for none, or for bytes that are not UTF-8."""
    try:
        return None if value is None else value.decode()
    except UnicodeDecodeError:
        return None


async def _take_over(app: web.Application, state: IngressState, store: ResponseStore,
                     orphan: tuple[str, str]) -> None:  # fmt: skip
    response_id, dead = orphan
    if not await store.take_over(response_id, dead, state.frontend_id):
        return  # another replica was first
    try:
        turn = await _turn_of(state, store, response_id)
    except Exception:
        await store.take_over(response_id, state.frontend_id, dead)  # for a later try
        raise
    if turn is not None:
        logger.info("background response %s: taken over from %s", response_id, dead)
        run(app, turn)


async def _turn_of(state: IngressState, store: ResponseStore, response_id: str) -> Turn | None:
    """The turn of an orphan: its job's replies read on, or its job submitted again; None
    if it cannot run here (then it is stored failed)."""
    try:
        return await resume.resumed_turn(state, store, response_id)
    except ApiError as exc:
        if exc.status != 404:
            raise
    try:
        return await _again(state, store, response_id)  # never submitted: run it now
    except ApiError as refused:  # its body makes no job here (another model, a bound)
        failed = {**await store.get(response_id), "status": "failed",
                  "error": error_object(refused)}  # fmt: skip
        await store.update(failed, await store.history(response_id))
        return None


async def _again(state: IngressState, store: ResponseStore, response_id: str) -> Turn:
    """The turn of a background response whose job never ran, to submit here."""
    stored, origin = await store.stream_origin(response_id)
    assert origin is not None
    history = await store.history(response_id)  # the earlier turns and this one's input
    raw = await store.client.hmget(store.key(response_id), ["owner", "tenant"])
    owner, tenant = (value.decode() or None if value else None for value in raw)
    asked = dataclasses.replace(parse_responses(origin.request, state.model), input=[])
    job = asked.chat_job(history, state.model)
    job.stream = True  # resumable, as the first run's
    await job.compile_grammar()
    await store.moved(response_id, state.frontend_id)
    builder = ResponseBuilder({**stored, "status": "in_progress"},
                              None if job.tools is None else job.tools.names)  # fmt: skip
    return Turn(state, job, builder, state.tenants.named(tenant), owner, store, history,
                StreamOrigin(state.frontend_id, origin.request), stored=True)  # fmt: skip


async def _start(app: web.Application) -> None:
    app[KEEPER] = asyncio.get_running_loop().create_task(_keep(app))


async def _stop_all(app: web.Application) -> None:
    """On shutdown, while Redis is still there: stop the keeper and this replica's tasks."""
    await cancel_and_wait([app[KEEPER], *app[TASKS].values()])


def add_to(app: web.Application) -> None:
    app[TASKS] = {}
    app.on_startup.append(_start)
    app.on_shutdown.append(_stop_all)
