"""The generation endpoints: OpenAI's chat completions and completions, and the native
/generate (the others are service_endpoints.py's).

A generation request is checked (params.py), admitted (a live worker, room in the queue),
submitted, and answered only once every sub-request has replied once: a rejection found
downstream (a prompt past the context, a token id outside the vocabulary) is then still a
4xx. Once a stream has begun, a later error is sent as an SSE ``data: {"error": ...}`` event,
which the OpenAI clients raise.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from aiohttp import web

from bus.replies import AsyncReplyReader
from jobs.protocol import ErrorReply, TextDelta
from stages.ingress.api.native_format import meta_info, native_logprobs, native_prompt_logprobs
from stages.ingress.api.openai_format import (
    ChatFormat,
    Choice,
    CompletionFormat,
    OpenAIFormat,
    system_fingerprint,
    timing_headers,
    usage,
)
from stages.ingress.api.params import (
    ApiRequest,
    parse_chat,
    parse_completion,
    parse_generate,
)
from stages.ingress.api.sse import ChunkEncoder, SSEStream, encode_json
from stages.ingress.api.tool_call_parser import ToolCallParser
from stages.ingress.body import read_object
from stages.ingress.errors import ApiError, error_body, redis_full, redis_unavailable
from stages.ingress.shards import Shard
from stages.ingress.state import STATE, IngressState
from stages.ingress.streaming import resume
from stages.ingress.streaming.submission import Submission
from stages.ingress.tenancy.auth import bearer_key
from stages.ingress.tenancy.ownership import owner_of
from stages.ingress.tenancy.tenants import Tenant

logger = logging.getLogger(__name__)


async def _resume_point(
    request: web.Request, state: IngressState, job: ApiRequest, choices: int
) -> tuple[resume.ResumePoint, Shard] | None:
    """A streamed request with Last-Event-ID resumes another replica's stream, on the shard
    that replica submitted it to."""
    last_event_id = request.headers.get(resume.HEADER) if job.stream else None
    return await resume.resume_point(state.shards, last_event_id, choices,
                                     owner_of(request, state.tenants))  # fmt: skip


def _with_ids(request: web.Request, job: ApiRequest) -> bool:
    """Whether a streamed answer carries event ids to resume from: only for clients that ask
    (streaming/resume.py); without them the stream is OpenAI's shape, lone data lines."""
    return job.stream and resume.wants_event_ids(request.headers, job.resumable)


def _resumed(
    state: IngressState, job: ApiRequest, point: resume.ResumePoint, shard: Shard
) -> Submission:
    """The submission of a request another (dead) replica began, read from its stream."""
    state.metrics.resumes.inc()
    reader = AsyncReplyReader(shard.redis, shard.config.reply_stream(point.frontend_id),
                              trim=False)  # fmt: skip
    return Submission(state, point.request_id, job.requests(point.request_id, reader.stream),
                      resumed=reader, resumable=True, shard=shard)  # fmt: skip


async def _submit(
    state: IngressState, job: ApiRequest, request_id: str, tenant: Tenant, owner: str | None,
    resumable: bool | None = None,
) -> Submission:  # fmt: skip
    """`resumable`: its stream carries event ids, so a shutdown hands it over rather than
    aborting it (None: any stream does)."""
    priority = tenant.priority_of(job.sampling.get("priority"))  # a 403 below the key's range
    if priority is not None:
        job.sampling["priority"] = priority
    await state.admit(len(job.prompts) * job.n)
    requests = job.requests(request_id, state.reply_stream, tenant.id, tenant.weight)
    resumable = job.stream if resumable is None else resumable
    return Submission(state, request_id, requests, resumable=resumable, tenant=tenant,
                      owner=owner, names=job.names)  # fmt: skip


# What the Responses API (stages/ingress/responses/) submits its chat jobs through.
submit = _submit


def _tenant(request: web.Request, state: IngressState) -> Tenant:
    return state.tenants.for_key(bearer_key(request))


# ---- OpenAI endpoints --------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    job = parse_chat(await read_object(request), state.model)
    await job.compile_grammar()
    return await _openai(request, state, job, ChatFormat())


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    job = parse_completion(await read_object(request), state.model)
    await job.compile_grammar()
    return await _openai(request, state, job, CompletionFormat())


async def _openai(
    request: web.Request, state: IngressState, job: ApiRequest, fmt: OpenAIFormat
) -> web.StreamResponse:
    request_id = fmt.id_prefix + uuid.uuid4().hex
    head = _head(state, fmt, request_id)
    resumed = await _resume_point(request, state, job, len(job.prompts) * job.n)
    point = None if resumed is None else resumed[0]
    head["id"] = request_id if point is None else point.request_id
    choices = _choices(job, head["id"])
    if resumed is not None:
        async with _resumed(state, job, *resumed) as sub:
            return await _stream_openai(request, sub, job, fmt, head, choices, point)
    owner = owner_of(request, state.tenants)
    ids = _with_ids(request, job)
    tenant = _tenant(request, state)
    async with await _submit(state, job, request_id, tenant, owner, ids) as sub:
        await sub.first_replies()
        if job.stream:
            return await _stream_openai(request, sub, job, fmt, head, choices, ids=ids)
        body = await _whole_openai(sub, job, fmt, head, choices)
    return web.json_response(
        body,
        dumps=lambda d: encode_json(d).decode(),
        headers=timing_headers(sub.timing([c.finish for c in choices])),
    )


async def answer_whole(
    state: IngressState, job: ApiRequest, fmt: OpenAIFormat, request_id: str, tenant: Tenant,
    owner: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The body of an OpenAI request answered whole, as `_openai` would answer it; what a
    batch line gets (stages/ingress/batches/runner.py), as its batch's `owner`. Raises
    ApiError as `_openai` does."""
    head = _head(state, fmt, request_id)
    choices = _choices(job, request_id)
    async with await _submit(state, job, request_id, tenant, owner) as sub:
        await sub.first_replies()
        return await _whole_openai(sub, job, fmt, head, choices)


def _head(state: IngressState, fmt: OpenAIFormat, request_id: str) -> dict[str, Any]:
    """The fields an OpenAI answer begins with."""
    return {"id": request_id, "object": fmt.whole_object, "created": int(time.time()),
            "model": state.model}  # fmt: skip


async def _whole_openai(
    sub: Submission, job: ApiRequest, fmt: OpenAIFormat, head: dict[str, Any],
    choices: list[Choice],
) -> dict[str, Any]:  # fmt: skip
    async for reply in sub.replies():
        if isinstance(reply, ErrorReply):
            raise ApiError.from_reply(reply)
        choice = choices[sub.index[reply.rid]]
        _echoed(job, fmt, choice, reply)
        choice.add(reply)
        if job.logprobs:
            fmt.logprobs(choice, reply)
    return {**head, "choices": [fmt.whole_choice(c) for c in choices],
            "usage": usage(choices, job.n),
            "system_fingerprint": system_fingerprint(choices)}  # fmt: skip


def _echoed(
    job: ApiRequest, fmt: OpenAIFormat, choice: Choice, reply: TextDelta
) -> tuple[str, dict[str, Any] | None]:
    """The prompt a completions choice echoes (and its logprobs), on the reply carrying it;
    ("", None) on any other."""
    if not job.echo or reply.prompt_ids is None or not isinstance(fmt, CompletionFormat):
        return "", None
    return fmt.echo(choice, reply, job.echo_text(choice.index), job.logprobs)


def _choices(job: ApiRequest, request_id: str) -> list[Choice]:
    choices = [Choice(i) for i in range(len(job.prompts) * job.n)]
    if job.tools is not None:
        for c in choices:  # call ids from the request's: a resumed stream repeats them
            c.tool_parser = ToolCallParser(job.tools.names, f"{request_id[-12:]}{c.index}")
    return choices


async def _stream_openai(
    request: web.Request,
    sub: Submission,
    job: ApiRequest,
    fmt: OpenAIFormat,
    head: dict[str, Any],
    choices: list[Choice],
    resumed: resume.ResumePoint | None = None,
    ids: bool = True,
) -> web.StreamResponse:
    """With `ids` (always on a resumed stream) each event carries its id to resume from."""
    # Headers go out after every choice's first reply: time to first token is known, queue
    # and decode time are not yet (they come in no header of a stream).
    ttft = {} if resumed else {k: v for k, v in sub.timing([]).items() if k == "ttft"}
    out = await SSEStream.start(request, timing_headers(ttft))
    head = {**head, "object": fmt.chunk_object}
    extra = {"usage": None} if job.include_usage else {}  # as OpenAI: null until the last
    chunks = ChunkEncoder(head, extra)
    frontend_id = resumed.frontend_id if resumed else sub.state.frontend_id

    def event_id() -> str | None:
        return resume.event_id(head["id"], frontend_id, choices) if ids else None

    # A delta of text alone (no logprobs, echo, tool calls or finish: most of a stream) is
    # encoded from its choice's cached chunk (ChunkEncoder.encode_text), and relayed: its
    # event is added as the reply reader routes it, the handler not woken (Submission.relay).
    plain = not job.logprobs and not job.echo
    shapes = [_text_shape(fmt, c) for c in choices]

    def take(reply: TextDelta) -> bool:
        """Add the event of a delta of text alone; False (nothing done) for any other."""
        choice = choices[sub.index[reply.rid]]
        if not plain or reply.finish is not None or choice.tool_parser is not None:
            return False
        choice.named(reply)
        sent = resumed is not None and resumed.already_sent(choice.index, reply)
        return take_text(reply.rid, reply.text, reply.count, sent)

    def take_text(rid: str, text: str | None, tokens: int, sent: bool = False) -> bool:
        """`take` from a delta's fields (`sent`: its client had it, before a resume)."""
        index = sub.index[rid]
        choice = choices[index]
        choice.add_text(text, tokens)
        if text and not sent:
            chunk = chunks.encode_text(system_fingerprint([choice]), index, text, shapes[index])
            out.add_encoded(chunk, event_id())
        return True

    # Each chunk names the weights computing its request, known from its first deltas on.
    for early in sub.early_replies():
        if isinstance(early, TextDelta):
            choices[sub.index[early.rid]].named(early)
    for first in [] if resumed else fmt.first_chunk_choices(choices):
        out.add_encoded(chunks.encode(system_fingerprint(choices), [first]), event_id())
    by_fields = plain and job.tools is None and resumed is None
    sub.relay(take, out.write_now, take_text if by_fields else None)
    try:
        async for reply in sub.replies(before_wait=out.flush):
            if isinstance(reply, ErrorReply):
                out.add(error_body(reply))
                break
            if take(reply):
                continue
            index = sub.index[reply.rid]
            choice = choices[index]
            echoed, logprobs = _echoed(job, fmt, choice, reply)
            choice.add(reply)
            delta = fmt.delta(choice, echoed + (reply.text or ""), final=reply.finish is not None)
            if job.logprobs and reply.ids:
                part = fmt.logprobs(choice, reply)
                logprobs = part if logprobs is None else {k: logprobs[k] + part[k] for k in part}
            finish = choice.finish_reason if reply.finish is not None else None
            if resumed and resumed.already_sent(index, reply):
                continue  # the client had this one before it lost the stream
            if not delta and finish is None and logprobs is None:
                continue  # text held back (a partial character, a stop prefix, a tool call)
            chunk_choice = fmt.chunk_choice(choice, delta, logprobs, finish)
            fingerprint = system_fingerprint([choice])
            out.add_encoded(chunks.encode(fingerprint, [chunk_choice]), event_id())
        else:
            if job.include_usage:
                out.add(
                    {
                        **head,
                        "choices": [],
                        "usage": usage(choices, job.n),
                        "system_fingerprint": system_fingerprint(choices),
                    },
                )
    except (ConnectionError, OSError):
        if sub.state.draining:
            raise  # cut by a shutdown: the submission hands it over, to resume elsewhere
        return out.response  # the client left: nothing to send or log (the rest is aborted)
    except Exception as exc:
        logger.exception("stream %s failed", head["id"])
        out.add(error_body(_internal(exc)))
    await out.close()
    return out.response


def _text_shape(fmt: OpenAIFormat, choice: Choice) -> Callable[[str], dict[str, Any]]:
    """The chunk entry of `choice` for a text (no tool parser: `fmt.delta` only wraps it)."""
    return lambda text: fmt.chunk_choice(choice, fmt.delta(choice, text, False), None, None)


def _internal(exc: Exception) -> ApiError:
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return redis_unavailable(exc)
    if isinstance(exc, redis.OutOfMemoryError):
        return redis_full(exc)
    return ApiError(500, "internal error", "internal_error", None, "internal_error")


internal = _internal  # the Responses API's streams name a failure as chat's do


# ---- native /generate --------------------------------------------------------------------------


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    job = parse_generate(await read_object(request), state.model)
    await job.compile_grammar()
    request_id = uuid.uuid4().hex
    resumed = await _resume_point(request, state, job, 1)
    if resumed is not None:
        async with _resumed(state, job, *resumed) as sub:
            return await _stream_generate(request, sub, job, sub.requests[0].rid, resumed[0])
    owner = owner_of(request, state.tenants)
    ids = _with_ids(request, job)
    tenant = _tenant(request, state)
    async with await _submit(state, job, request_id, tenant, owner, ids) as sub:
        rid = sub.requests[0].rid
        await sub.first_replies()
        if job.stream:
            return await _stream_generate(request, sub, job, rid, ids=ids)
        text, ids, last = [], [], None
        logprobs: dict[str, list] = {"output_token_logprobs": [], "output_top_logprobs": []}
        prompt_logprobs: dict[str, list] = {}
        async for reply in sub.replies():
            if isinstance(reply, ErrorReply):
                raise ApiError.from_reply(reply)
            text.append(reply.text or "")
            ids.extend(reply.ids)
            last = reply
            if job.logprobs:
                for key, values in native_logprobs(reply).items():
                    logprobs[key].extend(values)
            prompt_logprobs.update(native_prompt_logprobs(reply))
    meta = meta_info(last, rid)
    meta.update(sub.timing([None if last is None else last.finish_info()]))
    if job.logprobs:
        meta.update(logprobs)
    meta.update(prompt_logprobs)
    return web.json_response({"text": "".join(text), "output_ids": ids, "meta_info": meta})


async def _stream_generate(
    request: web.Request,
    sub: Submission,
    job: ApiRequest,
    rid: str,
    resumed: resume.ResumePoint | None = None,
    ids: bool = True,
) -> web.StreamResponse:
    out = await SSEStream.start(request)
    frontend_id = resumed.frontend_id if resumed else sub.state.frontend_id
    choice = Choice(0)  # for the event ids' progress
    try:
        async for reply in sub.replies(before_wait=out.flush):
            if isinstance(reply, ErrorReply):
                out.add(error_body(reply))
                break
            choice.add(reply)
            if resumed and resumed.already_sent(0, reply):
                continue  # the client had this one before it lost the stream
            meta = meta_info(reply, rid)
            if reply.finish is not None:
                meta.update(sub.timing([reply.finish_info()]))
            if job.logprobs:
                meta.update(native_logprobs(reply))
            meta.update(native_prompt_logprobs(reply))
            out.add(
                {"text": reply.text or "", "output_ids": reply.ids, "meta_info": meta},
                resume.event_id(sub.request_id, frontend_id, [choice]) if ids else None,
            )
    except (ConnectionError, OSError):
        if sub.state.draining:
            raise  # cut by a shutdown: the submission hands it over, to resume elsewhere
        return out.response  # the client left: nothing to send or log (the rest is aborted)
    except Exception as exc:
        logger.exception("stream %s failed", rid)
        out.add(error_body(_internal(exc)))
    await out.close()
    return out.response
