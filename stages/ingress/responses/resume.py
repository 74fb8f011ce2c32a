"""Resuming a Responses stream whose ingress replica died, OpenAI's way:
``GET /v1/responses/{id}?stream=true&starting_after=<sequence number>``.

A streamed response is stored with the replica streaming it and its create body
(store.py). Its job is not aborted when that replica dies: it runs to its end, its replies
landing on the dead replica's reply stream (streaming/resume.py says why and for how long).
A resume reads that stream from its start through a resumed Submission, makes the same
events again from the same replies (their sequence numbers and item ids are a function of
the replies: output.py), sends those after ``starting_after``, and stores the response as it
ends. As with chat's resume, only the response's owner resumes it (another's is a 404), a
stream whose replica is alive is a 409, and one whose job has ended and been cleaned up is
a 404; a response that was not streamed is a 400.
"""

from __future__ import annotations

from aiohttp import web

from bus.replies import AsyncReplyReader
from stages.ingress.errors import ApiError
from stages.ingress.responses.output import ResponseBuilder
from stages.ingress.responses.request import parse_responses
from stages.ingress.responses.store import RUNNING, ResponseStore
from stages.ingress.responses.turn import Turn
from stages.ingress.state import IngressState
from stages.ingress.streaming import resume
from stages.ingress.streaming.submission import Submission


def starting_after(request: web.Request) -> int:
    raw = request.query.get("starting_after")
    if raw is None:
        return -1
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"starting_after must be an integer; got {raw!r}",
                       param="starting_after", code="invalid_value") from None  # fmt: skip


async def resumed_turn(state: IngressState, store: ResponseStore, response_id: str) -> Turn:
    """The turn of a streamed response, its replies read again from its replica's stream."""
    stored, origin = await store.stream_origin(response_id)
    if origin is None:
        raise ApiError(400, f"response {response_id!r} was not streamed: retrieve it without "
                       "stream", param="stream", code="invalid_value")  # fmt: skip
    point = resume.ResumePoint(response_id, origin.frontend_id, (0,))
    found = await state.shards.read(lambda config: config.request_key(response_id))
    if found is None or stored["status"] not in RUNNING:
        raise ApiError(404, f"response {response_id!r} has ended; nothing to resume: retrieve "
                       "it without stream", param="response_id",
                       code="request_not_found")  # fmt: skip
    shard = found[0]
    await resume.check_resumable(shard.redis, shard.config, point, store.owner)
    job = parse_responses(origin.request, state.model).chat_job([], state.model)
    state.metrics.resumes.inc()
    reader = AsyncReplyReader(shard.redis, shard.config.reply_stream(origin.frontend_id),
                              trim=False)  # fmt: skip
    sub = Submission(state, response_id, job.requests(response_id, reader.stream),
                     resumed=reader, resumable=True, shard=shard)  # fmt: skip
    head = {**stored, "status": "in_progress", "output": [], "usage": None, "error": None,
            "incomplete_details": None}  # fmt: skip
    builder = ResponseBuilder(head, None if job.tools is None else job.tools.names)
    history = await store.history(response_id)  # as it began: the earlier turns and the input
    return Turn(state, job, builder, None, store.owner, store, history, origin, sub, stored=True)
