"""Resuming a stream whose ingress died: SSE event ids and ``Last-Event-ID``.

Streams look like OpenAI's unless their client asks for ids: each event a lone ``data:``
line, as ``vllm bench serve``, SGLang's bench_serving and many hand-written readers expect
(an ``id:`` line before each ``data:`` makes them fail every request). A client asks with
the header ``X-Resumable-Stream: true``, with ``"stream_options": {"resumable": true}`` (the
OpenAI endpoints), by resuming (``Last-Event-ID``), or by accepting ``text/event-stream``,
which browsers' EventSource and SSE libraries send and whose parsers read ids; the official
``openai`` clients accept ``application/json`` and the benchmark clients ``*/*``. An explicit
``false`` (the field before the header) turns ids off whatever the ``Accept``.

A stream with ids carries on each event an id ``<request id>/<frontend id>/<progress>``,
progress being each choice's output tokens relayed so far (``-`` once the choice's last
event was sent), e.g. ``cmpl-3f…/ingress-ab12/17.-.9``. The requests of an ingress that
dies are not aborted (no handler is left to abort them): they run to their end, their
replies landing on the dead replica's reply stream, which nobody trims any more. A client
that sends the same body again, to any ingress replica, with the last id it received in
``Last-Event-ID`` gets the rest: the replica reads that stream from its start, replays each
choice's replies up to the progress without sending them, and relays the rest live. Only
the request's owner resumes it (stages/ingress/tenancy/ownership.py): anyone else's resume
is a 404, as an unknown request's. A stream without ids cannot be resumed: cut by a
shutdown, its requests are aborted like any whose client left.

Only a dead replica's stream can be replayed: a live one trims what it has read. So a
replica announces itself (``frontend_key``, refreshed every second, expiring after a few) and
a resume of a stream whose replica is alive is a 409. A request that has ended (its
``request_key`` deleted) is a 404.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis
import redis.asyncio as aredis

from jobs.protocol import TextDelta
from runtime.config import BusConfig
from stages.ingress.api.openai_format import Choice
from stages.ingress.errors import ApiError
from stages.ingress.shards import Shard, Shards
from stages.ingress.tenancy.ownership import read_request_record, sees

HEADER = "Last-Event-ID"
OPT_IN_HEADER = "X-Resumable-Stream"
_YES, _NO = ("true", "1", "yes"), ("false", "0", "no")
ALIVE_INTERVAL_S = 1.0
ALIVE_TTL_S = 4
_NAME = r"([A-Za-z0-9._-]{1,200})"
_EVENT_ID = re.compile(rf"^{_NAME}/{_NAME}/((?:\d+|-)(?:\.(?:\d+|-))*)$")


@dataclass(frozen=True)
class ResumePoint:
    request_id: str
    frontend_id: str
    sent: tuple[int | None, ...]  # per choice: tokens relayed; None: finished

    def already_sent(self, index: int, delta: TextDelta) -> bool:
        """Whether the event of choice `index`'s `delta` reached the client before it lost
        the stream."""
        sent = self.sent[index]
        if sent is None:
            return True
        return delta.seq + delta.count <= sent and delta.finish is None


def wants_event_ids(headers: Mapping[str, str], asked: bool | None = None) -> bool:
    """Whether a stream's client asked for event ids (see the module docstring): `asked` is
    its body's ``stream_options.resumable``, None where it says nothing."""
    if asked is not None:
        return asked
    said = headers.get(OPT_IN_HEADER, "").strip().lower()
    if said in _YES or said in _NO:
        return said in _YES
    return HEADER in headers or "text/event-stream" in headers.get("Accept", "").lower()


def event_id(request_id: str, frontend_id: str, choices: Sequence[Choice]) -> str:
    progress = ".".join("-" if c.finish is not None else str(c.tokens) for c in choices)
    return f"{request_id}/{frontend_id}/{progress}"


def parse_event_id(value: str, choices: int) -> ResumePoint:
    match = _EVENT_ID.match(value.strip())
    if match is None:
        raise ApiError(400, f"{HEADER} is not an event id this server sent: {value[:80]!r}",
                       param=HEADER, code="invalid_value")  # fmt: skip
    request_id, frontend_id, progress = match.groups()
    sent = tuple(None if part == "-" else int(part) for part in progress.split("."))
    if len(sent) != choices:
        raise ApiError(
            400,
            f"{HEADER} names {len(sent)} choices; this request body makes {choices}",
            param=HEADER,
            code="invalid_value",
        )
    return ResumePoint(request_id, frontend_id, sent)


async def resume_point(
    shards: Shards, last_event_id: str | None, choices: int, caller: str | None = None
) -> tuple[ResumePoint, Shard] | None:
    """Where `caller`'s request with this ``Last-Event-ID`` resumes, and the shard it was
    submitted to (stages/ingress/shards.py); None without one. An id that cannot be resumed
    is an ApiError saying why."""
    if not last_event_id:
        return None
    point = parse_event_id(last_event_id, choices)
    found = await shards.read(lambda config: config.request_key(point.request_id))
    shard = shards.own if found is None else found[0]
    await check_resumable(shard.redis, shard.config, point, caller)
    return point, shard


async def check_resumable(
    client: aredis.Redis, config: BusConfig, point: ResumePoint, caller: str | None = None
) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.get(config.request_key(point.request_id))
    pipe.exists(config.frontend_key(point.frontend_id))
    raw, alive = await pipe.execute()
    count, owner = (0, None) if raw is None else read_request_record(raw)
    if raw is None or not sees(caller, owner):
        raise ApiError(404, f"request {point.request_id!r} has ended or is unknown; nothing to "
                       "resume", param=HEADER, code="request_not_found")  # fmt: skip
    if count != len(point.sent):
        raise ApiError(400, f"{HEADER} names {len(point.sent)} choices; the request has "
                       f"{count}", param=HEADER, code="invalid_value")  # fmt: skip
    if alive:
        raise ApiError(409, f"request {point.request_id!r} is still being streamed by its "
                       "ingress", param=HEADER, code="stream_in_progress")  # fmt: skip


async def announce_alive(client: aredis.Redis, config: BusConfig, frontend_id: str) -> None:
    """Refresh this replica's liveness key until cancelled (see the module docstring)."""
    key = config.frontend_key(frontend_id)
    while True:
        try:
            await client.set(key, 1, ex=ALIVE_TTL_S)
        except redis.RedisError:
            pass  # the reply reader logs Redis trouble; keep trying
        await asyncio.sleep(ALIVE_INTERVAL_S)
