"""One turn of a conversation: a Responses request's chat job run through the pipeline, its
replies turned into events and its Response object (output.py), and, when it is stored,
written to the store as it starts and as it ends.

A whole answer, a stream and a background response all run `Turn.events`; they differ only
in what they do with the events (nothing, send them, nothing). An error before the job's
first reply (a prompt past the context, a full queue) is raised as the ApiError it is, so a
foreground request answers it as an HTTP error; one after it ends the response as failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from jobs.protocol import ErrorReply
from stages.ingress.api import handlers
from stages.ingress.api.params import ApiRequest
from stages.ingress.errors import ApiError
from stages.ingress.responses.output import ResponseBuilder
from stages.ingress.responses.request import renamed
from stages.ingress.responses.store import ResponseStore, StreamOrigin
from stages.ingress.state import IngressState
from stages.ingress.streaming.submission import Submission
from stages.ingress.tenancy.tenants import Tenant


@dataclass
class Turn:
    state: IngressState
    job: ApiRequest
    builder: ResponseBuilder
    tenant: Tenant | None  # None: resumed (admitted when it began)
    owner: str | None
    store: ResponseStore | None  # None: store false, nothing is kept
    history: list[dict[str, Any]]  # the conversation before the answer: earlier turns, input
    stream: StreamOrigin | None = None  # a stream's, kept with it for a resume
    resumed: Submission | None = None  # a dead replica's job, read from its reply stream
    stored: bool = False  # whether the store holds it yet
    saved_last: bool = False  # whether the store holds it as it ended
    error: ApiError | None = None  # what failed it, after the first reply
    request: dict[str, Any] | None = None  # the create body, kept with it (its input items)

    @property
    def response(self) -> dict[str, Any]:
        return self.builder.response

    async def save(self) -> None:
        """Write the response as it is now (if it is stored)."""
        if self.store is None:
            return
        history = [*self.history, *self.builder.history()]
        if self.stored:
            await self.store.update(self.response, history)
        else:
            tenant = None if self.tenant is None else self.tenant.id
            await self.store.create(self.response, history, self.stream, tenant, self.request)
            self.stored = True

    async def events(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The events of the turn, a reply's at a time; run it in `contextlib.aclosing`, so
        the job is aborted as soon as its reader stops."""
        sub = self.resumed
        if sub is None:
            assert self.tenant is not None
            sub = await handlers.submit(self.state, self.job, self.response["id"], self.tenant,
                                        self.owner)  # fmt: skip
        async with sub:
            try:
                await sub.first_replies()
            except ApiError as exc:  # a refusal downstream names the chat job's field
                raise renamed(exc) from None
            started = self.builder.started()
            await self.save()
            yield started
            async for reply in sub.replies():
                if isinstance(reply, ErrorReply):
                    self.error = renamed(ApiError.from_reply(reply))
                    yield self.builder.failed(self.error)
                    break
                events = self.builder.add(reply)
                if events:
                    yield events
        await self.save()
        self.saved_last = True

    async def whole(self) -> dict[str, Any]:
        """The finished Response object; an error raised as the chat endpoint raises it."""
        async for _ in self.events():
            pass
        if self.error is not None:
            raise self.error
        return self.response
