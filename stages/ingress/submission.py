"""One HTTP request's sub-requests, from their XADD to their last reply.

    async with Submission(state, request_id, requests) as sub:
        await sub.first_replies()      # an ErrorReply here becomes the HTTP status
        async for reply in sub.replies():
            ...

Every sub-request's replies go to one queue, each rid's in order (the reply reader orders
them). On exit, however it happens (done, an error, the client gone and the handler
cancelled), the sub-requests without a final reply are aborted, so a worker never keeps
generating for nobody.

No handler waits for ever: when none of its sub-requests has replied for
``reply_timeout_s`` (a job dropped somewhere, a queue that never moves), the wait ends with
a 504 ``reply_timeout`` error (an HTTP error before the first reply, an SSE error event
after it) and the unfinished sub-requests are aborted like any others.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator

from bus.protocol import ErrorReply, Finish, GenerateRequest, TextDelta
from bus.replies import AsyncReplyReader, Reply, is_terminal
from stages.ingress.errors import ApiError
from stages.ingress.state import IngressState
from stages.ingress.tenants import Tenant


class Submission:
    """With `resumed` (a reader of another replica's reply stream, stages/ingress/resume.py)
    nothing is submitted: the requests run already, and their replies are read from there."""

    def __init__(
        self,
        state: IngressState,
        request_id: str,
        requests: list[GenerateRequest],
        resumed: AsyncReplyReader | None = None,
        resumable: bool = False,
        tenant: Tenant | None = None,
    ) -> None:
        self.state = state
        self.resumable = resumable  # streamed: its client can resume it elsewhere
        self.request_id = request_id
        self.reader = resumed if resumed is not None else state.replies
        self.resumed = resumed is not None
        self.requests = requests
        self.index = {request.rid: i for i, request in enumerate(requests)}
        self.queue: asyncio.Queue[Reply] = asyncio.Queue()
        self.finished: set[str] = set()
        self._early: collections.deque[Reply] = collections.deque()
        self._arrived = time.monotonic()
        self._last_token_at: dict[str, float] = {}
        self.first_token_at: dict[str, float] = {}  # monotonic, per sub-request
        self.tenant = tenant  # whose limits it counts against; None: resumed, not admitted
        self.tokens = 0  # prompt and completion tokens of its finished sub-requests

    async def __aenter__(self) -> Submission:
        for request in self.requests:
            self.reader.register(request.rid, self.queue)
        if self.resumed:
            self.reader.start()
            return self
        try:
            if self.tenant is not None:
                await self.state.tenant_limits.admit(self.tenant, self.request_id)
                self.state.running_tenants[self.request_id] = self.tenant
            await self.state.submit(self.request_id, self.requests)
            self.state.live_requests.add(self.request_id)
        except BaseException as exc:
            self._release()
            self._unregister()
            if isinstance(exc, asyncio.CancelledError):  # the jobs may be queued already
                self.state.finish_soon(self.request_id, list(self.index))
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if not self.resumed:
            self.state.live_requests.discard(self.request_id)
        self._unregister()
        self._release()
        if self.resumed:
            await self.reader.close(delete_stream=False)  # another resume may need it
        unfinished = [r.rid for r in self.requests if r.rid not in self.finished]
        if unfinished and self.resumable and self.state.draining and exc_type is not None:
            # Cut by a shutdown, not by its client: it runs on, and its client resumes it
            # on another replica with Last-Event-ID.
            self.state.handed_over += 1
            return
        if unfinished:
            self.state.metrics.aborts.inc(len(unfinished))
        self.state.finish_soon(self.request_id, unfinished)

    def _release(self) -> None:
        """Give back the tenant's running slot and count the tokens used (from a task of
        its own, as aborts are: the handler may be being cancelled)."""
        if self.state.running_tenants.pop(self.request_id, None) is not None:
            assert self.tenant is not None
            self.state.release_soon(self.tenant, self.request_id, self.tokens)

    def _unregister(self) -> None:
        for request in self.requests:
            self.reader.unregister(request.rid)

    async def first_replies(self) -> None:
        """Wait until every sub-request has replied once; raise an ErrorReply as an ApiError."""
        waiting = set(self.index)
        while waiting:
            reply = await self._next_reply()
            if reply is None:
                raise ApiError.from_reply(self._timed_out())
            self._early.append(reply)
            waiting.discard(reply.rid)
            if isinstance(reply, TextDelta) and reply.ids:
                # When it came, not when it is handled: a stream's headers report it.
                self.first_token_at.setdefault(reply.rid, time.monotonic())
            if isinstance(reply, ErrorReply):
                self._note(reply)
                raise ApiError.from_reply(reply)

    async def replies(self) -> AsyncIterator[Reply]:
        """Every reply (the early ones first) until each sub-request has its last one."""
        while self._early or len(self.finished) < len(self.requests):
            reply = self._early.popleft() if self._early else await self._next_reply()
            if reply is None:
                # Not noted as finished: the exit aborts the sub-requests that timed out.
                yield self._timed_out()
                return
            self._note(reply)
            yield reply

    async def _next_reply(self) -> Reply | None:
        """The next reply; None after reply_timeout_s without one."""
        try:
            return await asyncio.wait_for(self.queue.get(), self.state.config.reply_timeout_s)
        except asyncio.TimeoutError:
            return None

    def _timed_out(self) -> ErrorReply:
        rid = next(r.rid for r in self.requests if r.rid not in self.finished)
        timeout = self.state.config.reply_timeout_s
        return ErrorReply(rid, 504, f"no reply for {timeout:g} s: the request was aborted",
                          "timeout", None, "reply_timeout")  # fmt: skip

    def _note(self, reply: Reply) -> None:
        if is_terminal(reply):
            self.finished.add(reply.rid)
            finish = reply.finish_info() if isinstance(reply, TextDelta) else None
            if finish is not None:
                self.tokens += finish.prompt_tokens + finish.completion_tokens
        if isinstance(reply, TextDelta) and not self.resumed:  # a replay would count twice
            self._time_tokens(reply)

    def _time_tokens(self, delta: TextDelta) -> None:
        metrics = self.state.metrics
        now = time.monotonic()
        if delta.ids:
            last = self._last_token_at.get(delta.rid)
            if last is None:
                now = self.first_token_at.setdefault(delta.rid, now)
                metrics.token_times(True, now - self._arrived, len(delta.ids))
            else:
                metrics.token_times(False, now - last, len(delta.ids))
            self._last_token_at[delta.rid] = now
        if delta.finish is not None:
            metrics.e2e.observe(now - self._arrived)

    def timing(self, finishes: list[Finish | None]) -> dict[str, float]:
        """The request's figures so far, in seconds, over its sub-requests: queue time (the
        workers', from the Finishes: the shortest), time to its first token, and decode time
        (from there to its last token so far)."""
        figures = {}
        queued = [
            f.queue_seconds for f in finishes if f is not None and f.queue_seconds is not None
        ]
        if queued:
            figures["queue_time"] = min(queued)
        if self.first_token_at:
            first = min(self.first_token_at.values())
            figures["ttft"] = first - self._arrived
            figures["decode_time"] = max(self._last_token_at.values(), default=first) - first
        return figures
