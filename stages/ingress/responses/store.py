"""Stored responses, kept in Redis on the home shard (stages/ingress/shards.py), so any
ingress replica answers for any of them.

A response is one hash, ``<p>:response:<id>``: its owner (tenancy/ownership.py; empty in
single-tenant mode), its status, its Response object (JSON) and its conversation so far as
chat messages (JSON: the earlier turns', this turn's input, its answer), which a later
``previous_response_id`` continues; a streamed one also the replica streaming it and its
create body, which a resume needs (resume.py). It expires ``response_ttl_s`` after its
last write, or goes sooner to make room for its owner's newer ones (quota.py). Another
owner's response is a 404, as a missing one is.

The status is a field of its own so that a cancel can set it without rewriting the object:
a write after a cancel (the job's last replies) leaves it cancelled, and a write after a
delete makes nothing again (both in one script, `_UPDATE`). A background response also
keeps its runner (the replica running it) and tenant, and is listed in
``<p>:responses:background`` until it ends, so that another replica takes it over if its
runner dies (background.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from batch_store.files import not_found
from runtime.config import BusConfig
from stages.ingress.responses.quota import ResponseQuota
from stages.ingress.tenancy.ownership import sees

RUNNING = ("queued", "in_progress")

# KEYS[1] the hash, KEYS[2] the running background responses; ARGV: status, body, history,
# ttl, id. Only a response that exists and is not cancelled is updated; one that has ended
# leaves the set.
_UPDATE = """
local status = redis.call('hget', KEYS[1], 'status')
if not status or status == 'cancelled' then return 0 end
redis.call('hset', KEYS[1], 'status', ARGV[1], 'body', ARGV[2], 'history', ARGV[3])
redis.call('expire', KEYS[1], ARGV[4])
if ARGV[1] ~= 'queued' and ARGV[1] ~= 'in_progress' then redis.call('srem', KEYS[2], ARGV[5]) end
return 1
"""
# KEYS as _UPDATE's; ARGV[1] the id. A running response becomes cancelled; returns the
# status it had.
_CANCEL = """
local status = redis.call('hget', KEYS[1], 'status')
if status == 'queued' or status == 'in_progress' then
  redis.call('hset', KEYS[1], 'status', 'cancelled')
end
redis.call('srem', KEYS[2], ARGV[1])
return status
"""
# KEYS[1] the hash; ARGV: the runner taken for dead, the new one. Whether it was taken.
_TAKE_OVER = """
if redis.call('hget', KEYS[1], 'runner') ~= ARGV[1] then return 0 end
redis.call('hset', KEYS[1], 'runner', ARGV[2])
return 1
"""


@dataclass(frozen=True)
class StreamOrigin:
    """Where a streamed response can be resumed from (responses/resume.py)."""

    frontend_id: str  # the ingress replica that streamed it: its reply stream holds the replies
    request: dict[str, Any]  # the create body, which makes the same job again


class ResponseStore:
    """The responses `owner` sees (every response when None)."""

    def __init__(self, client: aredis.Redis, config: BusConfig, owner: str | None) -> None:
        self.client = client
        self.config = config
        self.owner = owner
        self.quota = ResponseQuota(client, config)

    def key(self, response_id: str) -> str:
        return self.config.key_name("response", response_id)

    @property
    def background_index(self) -> str:
        """The background responses still running (background.py watches their runners)."""
        return self.config.key_name("responses", "background")

    async def create(
        self, response: dict[str, Any], history: list[dict[str, Any]],
        stream: StreamOrigin | None = None, tenant: str | None = None,
        request: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """A new stored response (as it starts), with its create body (`request`: its input
        items); a streamed or background one with where its replies go, a background one
        with its runner (that replica) and tenant."""
        key = self.key(response["id"])
        fields = {"owner": self.owner or "", "status": response["status"],
                  "body": _dumps(response), "history": _dumps(history)}  # fmt: skip
        if request is not None:
            fields["request"] = _dumps(request)
        if stream is not None:
            fields.update(frontend=stream.frontend_id, request=_dumps(stream.request))
        background = bool(response["background"] and stream is not None)
        if background:
            fields.update(runner=stream.frontend_id, tenant=tenant or "")
        await self.quota.store(self.owner, response["id"], key, self.background_index, fields,
                               background)  # fmt: skip

    async def update(self, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Its new state, unless it was cancelled or deleted meanwhile: whether it was written."""
        keys = (self.key(response["id"]), self.background_index)
        written = await self.client.eval(_UPDATE, 2, *keys, response["status"], _dumps(response),
                                         _dumps(history), self.config.response_ttl_s,
                                         response["id"])  # fmt: skip
        return bool(written)

    async def take_over(self, response_id: str, dead: str, runner: str) -> bool:
        """Make `runner` the runner of a background response whose runner `dead` died,
        unless another replica did first."""
        return bool(await self.client.eval(_TAKE_OVER, 1, self.key(response_id), dead, runner))

    async def moved(self, response_id: str, frontend_id: str) -> None:
        """Its job runs again from the start, replying to `frontend_id`."""
        await self.client.hset(self.key(response_id), "frontend", frontend_id)

    async def _visible(self, response_id: str, *fields: str) -> list[Any]:
        """`fields` of a response this store's owner sees; a 404 for any other."""
        values = await self.client.hmget(self.key(response_id), ["owner", *fields])
        owner = values[0]
        if owner is None or not sees(self.owner, owner.decode() or None):
            raise not_found("response", response_id)
        return values[1:]

    async def get(self, response_id: str) -> dict[str, Any]:
        status, body = await self._visible(response_id, "status", "body")
        response = json.loads(body)
        response["status"] = status.decode()
        return response

    async def stream_origin(self, response_id: str) -> tuple[dict[str, Any], StreamOrigin | None]:
        """A response (404 as `get`) and, if it was streamed, where from."""
        status, body, frontend, request = await self._visible(
            response_id, "status", "body", "frontend", "request"
        )
        response = {**json.loads(body), "status": status.decode()}
        if frontend is None:
            return response, None
        return response, StreamOrigin(frontend.decode(), json.loads(request))

    async def request(self, response_id: str) -> dict[str, Any]:
        """The body that created a response (404 as `get`)."""
        (request,) = await self._visible(response_id, "request")
        return {} if request is None else json.loads(request)

    async def history(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation a later turn continues (404 as `get`)."""
        (history,) = await self._visible(response_id, "history")
        return json.loads(history)

    async def delete(self, response_id: str) -> dict[str, Any]:
        (owner,) = await self._visible(response_id, "owner")
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.key(response_id))
        pipe.srem(self.background_index, response_id)
        await pipe.execute()
        await self.quota.forget(owner.decode() or None, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> str:
        """Mark a running response cancelled; the status it had (404 as `get`)."""
        await self._visible(response_id)
        keys = (self.key(response_id), self.background_index)
        status = await self.client.eval(_CANCEL, 2, *keys, response_id)
        if status is None:
            raise not_found("response", response_id)  # deleted meanwhile
        return status.decode()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
