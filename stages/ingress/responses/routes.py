"""``/v1/responses``: create (whole, streamed or in the background), retrieve, delete, cancel,
and a response's input items (items.py).

A streamed response is SSE events of the form ``event: <type>`` then ``data: <JSON>``, as
OpenAI sends them (no ``[DONE]``); with ``GET ...?stream=true`` one whose replica died is
resumed (resume.py). A background response is answered at once, ``queued``, and runs in a
task (background.py); any replica answers its retrieve from the store, and its cancel: the
replica running it stops its task, another one aborts its job on the bus (its request id
is the response id) and marks it ``cancelled`` in the store, which its runner's last write
then leaves as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import redis
from aiohttp import web

from bus.aborts import publish_aborts_async
from jobs.errors import RequestError
from stages.ingress.api import handlers
from stages.ingress.body import read_object
from stages.ingress.errors import ApiError
from stages.ingress.responses import background, items, resume
from stages.ingress.responses.output import ResponseBuilder, new_response_id, response_head
from stages.ingress.responses.request import parse_responses, renamed
from stages.ingress.responses.store import RUNNING, ResponseStore, StreamOrigin
from stages.ingress.responses.turn import Turn
from stages.ingress.state import STATE, IngressState
from stages.ingress.tenancy.auth import bearer_key
from stages.ingress.tenancy.ownership import owner_of

logger = logging.getLogger(__name__)


def _store(request: web.Request) -> ResponseStore:
    """The responses the request's owner sees, on the home shard."""
    state = request.app[STATE]
    home = state.shards.home
    return ResponseStore(home.redis, home.config, owner_of(request, state.tenants))


def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body, dumps=lambda d: json.dumps(d, ensure_ascii=False))


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    asked = parse_responses(await read_object(request), state.model)
    store = _store(request)
    history: list[dict[str, Any]] = []
    if asked.previous_response_id is not None:
        try:
            history = await store.history(asked.previous_response_id)
        except RequestError as exc:  # a 404 naming the field
            exc.param = "previous_response_id"
            raise
    job = asked.chat_job(history, state.model)
    try:
        await job.compile_grammar()
    except ApiError as exc:
        raise renamed(exc) from None
    response_id = new_response_id()
    status = "queued" if asked.background else "in_progress"
    builder = ResponseBuilder(response_head(response_id, state.model, asked.data, status),
                              None if job.tools is None else job.tools.names)  # fmt: skip
    if asked.background:
        # Resumable, as a stream is: on SIGTERM its job is handed over, not aborted, and
        # another replica takes it over (background.py).
        job.stream = True
    resumable = asked.stream or asked.background
    origin = StreamOrigin(state.frontend_id, asked.data) if resumable else None
    turn = Turn(state, job, builder, state.tenants.for_key(bearer_key(request)), store.owner,
                store if asked.store else None, [*history, *asked.input], origin,
                request=asked.data)  # fmt: skip
    if asked.background:
        await turn.save()
        background.run(request.app, turn)
        return _json(turn.response)
    return await _answer(request, turn, asked.stream)


async def _answer(
    request: web.Request, turn: Turn, stream: bool, starting_after: int = -1
) -> web.StreamResponse:
    """The turn answered whole or streamed (the events after `starting_after`)."""
    try:
        return await _relay(request, turn, starting_after) if stream else _json(await turn.whole())
    finally:
        # Cut short (its client left, it failed) and not handed over on a shutdown, as a
        # stream is (streaming/submission.py): stored as it was left.
        handed_over = turn.state.draining and turn.job.stream
        if turn.stored and not turn.saved_last and not handed_over:
            if turn.response["status"] in RUNNING:
                turn.response["status"] = "cancelled"
            with contextlib.suppress(redis.RedisError, TimeoutError):
                await asyncio.wait_for(turn.save(), background.STOP_SAVE_S)


async def _relay(request: web.Request, turn: Turn, starting_after: int) -> web.StreamResponse:
    """The turn's events as SSE, once its job has replied (an error before that is a 4xx)."""
    response: web.StreamResponse | None = None
    try:
        async with contextlib.aclosing(turn.events()) as events:
            async for batch in events:
                if response is None:
                    response = web.StreamResponse(headers={
                        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no"})  # fmt: skip
                    await response.prepare(request)
                await _write(response, [e for e in batch if e["sequence_number"] > starting_after])
    except Exception as exc:
        if response is None:
            raise  # an ApiError is the request's 4xx, as chat's is
        if isinstance(exc, (ConnectionError, OSError)):
            return response  # the client left: its job is aborted as the events close
        logger.exception("response %s failed", turn.response["id"])
        await _write(response, turn.builder.failed(handlers.internal(exc)))
    await response.write_eof()
    return response


async def _write(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    for event in events:
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        await response.write(f"event: {event['type']}\ndata: {data}\n\n".encode())


async def retrieve(request: web.Request) -> web.StreamResponse:
    """A stored response; with ``stream=true`` its stream resumed (resume.py)."""
    store, response_id = _store(request), request.match_info["response_id"]
    if request.query.get("stream", "false").lower() != "true":
        return _json(await store.get(response_id))
    after = resume.starting_after(request)
    return await _answer(
        request, await resume.resumed_turn(request.app[STATE], store, response_id), True, after
    )


async def list_input_items(request: web.Request) -> web.Response:
    store, response_id = _store(request), request.match_info["response_id"]
    raw = (await store.request(response_id)).get("input")
    limit = request.query.get("limit", "20")
    if not limit.lstrip("-").isdigit():
        raise ApiError(400, f"limit must be an integer; got {limit!r}", param="limit",
                       code="invalid_value")  # fmt: skip
    listed = items.page(items.input_items(raw, response_id), request.query.get("order", "desc"),
                        request.query.get("after"), int(limit))  # fmt: skip
    return _json(listed)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    store = _store(request)
    deleted = await store.delete(response_id)
    background.stop(request.app, response_id)  # nothing is left to write its answer to
    return _json(deleted)


async def cancel(request: web.Request) -> web.Response:
    """Cancel a background response: it stops, and keeps what it had when cancelled."""
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    store = _store(request)
    response = await store.get(response_id)
    if not response.get("background"):
        raise ApiError(400, "only a background response can be cancelled", param="response_id",
                       code="invalid_value")  # fmt: skip
    if await store.cancel(response_id) in RUNNING:
        await _stop(state, request.app, response_id, store.owner)
    return _json(await store.get(response_id))


async def _stop(state: IngressState, app: web.Application, response_id: str,
                owner: str | None) -> None:  # fmt: skip
    """Stop the job of a cancelled response, wherever it runs."""
    if background.stop(app, response_id):
        return  # its submission aborts the job
    found = await state.sub_requests(response_id, owner)
    if found is not None:
        shard, rids = found
        await publish_aborts_async(shard.redis, shard.config, rids)


def add_routes(app: web.Application) -> None:
    background.add_to(app)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
