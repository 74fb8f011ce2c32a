"""One HTTP request's sub-requests, from their XADD to their last reply.

    async with Submission(state, request_id, requests) as sub:
        await sub.first_replies()      # an ErrorReply here becomes the HTTP status
        async for reply in sub.replies():
            ...

Every sub-request's replies go to one queue, each rid's in order (the reply reader orders
them). On exit, however it happens (done, an error, the client gone and the handler
cancelled), the sub-requests without a final reply are aborted, so a worker never keeps
generating for nobody.

Tokens are charged to the request's tenant as the ingress learns of them (its limits,
stages/ingress/tenancy/limits.py): a prompt of token ids on submission, each reply's new
tokens as it is handled, and at a sub-request's end the rest of what its Finish counts
(a text prompt's tokens, ids the replies held back). A sub-request whose client went away
is still charged in full: its replies are read on, for up to ``SETTLE_S``, until the
worker's last one (its Finish, reason "abort") says what it used.

No handler waits for ever: when none of its sub-requests has replied for
``reply_timeout_s`` (a job dropped somewhere, a queue that never moves), the wait ends with
a 504 ``reply_timeout`` error (an HTTP error before the first reply, an SSE error event
after it) and the unfinished sub-requests are aborted like any others.

A stream's handler may `relay` the replies it can answer at once (a delta of text alone):
those that come while it waits are handled in the reply reader's task as they are routed,
not queued, so a publish costs no wake-up of each stream's handler (one a reply was a fifth
of the ingress's CPU per event, with the reply's relaying and the send). Given a taker of
text and a count, it takes most of them from their wire fields, no TextDelta built (the
reader's sinks, bus/reply_router.py).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from bus.replies import AsyncReplyReader, Reply, is_terminal
from jobs.protocol import ErrorReply, Finish, GenerateRequest, TextDelta
from runtime.task_cancel import raise_if_cancel_lost
from stages.ingress.errors import ApiError, in_request_words
from stages.ingress.shards import Shard
from stages.ingress.state import IngressState
from stages.ingress.streaming.reply_queue import NUDGE, TIMED_OUT, Failed, ReplyQueue
from stages.ingress.tenancy.tenants import Tenant

SETTLE_S = 10.0  # how long a dropped request's last replies are awaited, to charge them


class Submission:
    """With `resumed` (a reader of another replica's reply stream, streaming/resume.py)
    nothing is submitted: the requests run already, and their replies are read from there."""

    def __init__(
        self,
        state: IngressState,
        request_id: str,
        requests: list[GenerateRequest],
        resumed: AsyncReplyReader | None = None,
        resumable: bool = False,
        tenant: Tenant | None = None,
        owner: str | None = None,
        shard: Shard | None = None,
        names: dict[str, str] | None = None,  # a job's field -> the request's (ApiRequest's)
    ) -> None:
        self.state = state
        self.names = names or {}
        self.shard = shard  # a resumed request's, where another replica submitted it
        self.resumable = resumable  # streamed: its client can resume it elsewhere
        self.request_id = request_id
        self.reader = resumed if resumed is not None else state.replies
        self.resumed = resumed is not None
        self.requests = requests
        self.index = {request.rid: i for i, request in enumerate(requests)}
        self.queue: asyncio.Queue[Reply] = ReplyQueue(self._relayed)
        self._take: Callable[[Reply], bool] | None = None  # the handler's relay
        self._take_text: Callable[[str, str | None, int], bool] | None = None  # and of text
        self._write: Callable[[Callable[[], None]], None] | None = None
        self._write_due = False  # once the reader's read is handed out
        self._waiting = False  # the handler waits for the queue
        self.finished: set[str] = set()
        self.workers: dict[str, str] = {}  # rid -> the worker its first delta named
        self._early: collections.deque[Reply] = collections.deque()
        self._arrived = time.monotonic()
        self._last_token_at: dict[str, float] = {}
        self.first_token_at: dict[str, float] = {}  # monotonic, per sub-request
        self.tenant = tenant  # whose limits it counts against; None: resumed, not admitted
        self._charges_tokens = tenant is not None and tenant.tokens_per_minute is not None
        self.owner = owner  # who may abort or resume it (stages/ingress/tenancy/ownership.py)
        self._charged: dict[str, int] = {}  # rid -> tokens (a Counter costs ~1 us to make)
        # One timer per reply_timeout_s of silence, not one per reply (wait_for cost ~45 us
        # a reply, more than the rest of relaying it).
        self._last_reply = time.monotonic()
        self._watchdog: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> Submission:
        for request in self.requests:
            self.reader.register(request.rid, self.queue)
            if not self.resumed and request.bundle_replies:
                # Its bundled replies name it by this tag (bus/reply_tags.py); a resumed
                # request's reader learns the tag from the stream.
                request.tag = self.reader.tag(request.rid)
        if self.resumed:
            self.reader.start()
            return self
        try:
            if self.tenant is not None and self.tenant.limited:  # no slots to take else
                await self.state.tenant_limits.admit(self.tenant, list(self.index))
                for rid in self.index:
                    self.state.running_tenants[rid] = self.tenant
            raise_if_cancel_lost()  # its client left meanwhile: no job for nobody
            await self.state.submit(self.request_id, self.requests, self.owner)
            for request in self.requests:
                if request.input_ids is not None:  # a prompt the ingress can count
                    self._charge(request.rid, len(request.input_ids))
            self.state.live_requests.add(self.request_id)
        except BaseException as exc:
            self._release()
            self._unregister()
            if isinstance(exc, asyncio.CancelledError):  # the jobs may be queued already
                self.state.finish_soon(self.request_id, list(self.index), self.shard)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._take = self._write = self._take_text = None  # the rest is queued (_settle)
        for rid in self.index:
            self.reader.set_sink(rid, None)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        unfinished = [r.rid for r in self.requests if r.rid not in self.finished]
        handed_over = (unfinished and self.resumable and self.state.draining
                       and exc_type is not None)  # fmt: skip
        settling = bool(unfinished) and not handed_over and self._charges_tokens
        if not self.resumed:
            self.state.live_requests.discard(self.request_id)
        self._unregister(keep=unfinished if settling else ())
        self._release()
        if self.resumed:
            await self.reader.close(delete_stream=False)  # another resume may need it
        if handed_over:
            # Cut by a shutdown, not by its client: it runs on, and its client resumes it
            # on another replica with Last-Event-ID.
            self.state.handed_over += 1
            return
        if unfinished:
            self.state.metrics.aborts.inc(len(unfinished))
        workers = {rid: self.workers[rid] for rid in unfinished if rid in self.workers}
        self.state.finish_soon(self.request_id, unfinished, self.shard, workers)
        if settling:
            self.state.settle_soon(self._settle(set(unfinished)))

    def _release(self) -> None:
        """Give back the tenant's running slots and send the tokens charged (from a task of
        its own, as aborts are: the handler may be being cancelled)."""
        rids = [rid for rid in self.index if self.state.running_tenants.pop(rid, None)]
        if rids:
            assert self.tenant is not None
            self.state.release_soon(self.tenant, rids)

    def _unregister(self, keep: Iterable[str] = ()) -> None:
        for rid in set(self.index) - set(keep):
            self.reader.unregister(rid)

    async def _settle(self, unfinished: set[str]) -> None:
        """Charge the sub-requests aborted as their client went away for what their last
        replies say they used; those not ended within SETTLE_S keep what was charged."""
        deadline = time.monotonic() + SETTLE_S  # wait_for, not asyncio.timeout: Python 3.10
        try:
            while unfinished:
                if self._early:
                    reply = self._early.popleft()
                else:
                    try:
                        reply = await asyncio.wait_for(self.queue.get(),
                                                       deadline - time.monotonic())  # fmt: skip
                    except asyncio.TimeoutError:
                        return
                if reply is TIMED_OUT or reply is NUDGE or isinstance(reply, Failed):
                    continue
                self._charge_reply(reply)
                if is_terminal(reply):
                    unfinished.discard(reply.rid)
        finally:
            self._unregister()

    async def first_replies(self) -> None:
        """Wait until every sub-request has replied once; raise an ErrorReply as an ApiError."""
        waiting = set(self.index)
        while waiting:
            reply = await self._next_reply()
            if reply is None:
                raise ApiError.from_reply(self._timed_out())
            self._early.append(reply)
            waiting.discard(reply.rid)
            if isinstance(reply, TextDelta) and reply.count:
                # When it came, not when it is handled: a stream's headers report it.
                self.first_token_at.setdefault(reply.rid, time.monotonic())
            if isinstance(reply, ErrorReply):
                self._note(reply)
                raise ApiError.from_reply(reply)

    def early_replies(self) -> list[Reply]:
        """The replies `first_replies` read, which `replies` hands out first."""
        return list(self._early)

    async def replies(
        self, before_wait: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[Reply]:
        """Every reply (the early ones first) until each sub-request has its last one;
        `before_wait` is awaited each time none is there yet (a stream writes then)."""
        while self._early or len(self.finished) < len(self.requests):
            if before_wait is not None and not self._early and self.queue.empty():
                await before_wait()
            reply = self._early.popleft() if self._early else await self._next_reply()
            if reply is None:
                # Not noted as finished: the exit aborts the sub-requests that timed out.
                yield self._timed_out()
                return
            if reply is NUDGE:
                continue  # a relayed event to write: before_wait writes it
            self._note(reply)
            yield reply

    async def _next_reply(self) -> Reply | None:
        """The next reply; None after reply_timeout_s without one."""
        raise_if_cancel_lost()  # a handler whose client left waits for nothing more
        if self.queue.empty() and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(
                self.state.config.reply_timeout_s, self._watch
            )
        self._waiting = True
        try:
            reply = await self.queue.get()
        finally:
            self._waiting = False
        if reply is TIMED_OUT or reply is NUDGE:
            return reply if reply is NUDGE else None
        if isinstance(reply, Failed):
            raise reply.exc
        failure = reply.failure() if type(reply) is TextDelta and reply.finish is not None else None
        if failure is not None:  # a Finish of reason error: answered as an ErrorReply
            self._charge_reply(reply)  # what it used, as any end's
            reply = failure
        if type(reply) is ErrorReply:
            reply = in_request_words(reply, self.names)
        self._received(reply)
        return reply

    def _received(self, reply: Reply) -> None:
        self._last_reply = time.monotonic()
        if isinstance(reply, TextDelta) and reply.worker is not None:
            self.workers[reply.rid] = reply.worker

    def relay(
        self, take: Callable[[Reply], bool], write: Callable[[Callable[[], None]], None],
        take_text: Callable[[str, str | None, int], bool] | None = None,
    ) -> None:  # fmt: skip
        """From now on, each reply that comes while the handler waits in `replies` goes to
        `take` at once, in the reply reader's task: True when it handled the reply (added
        its event), False to leave it to the handler (without having changed anything).
        A delta of text alone goes to `take_text` (its rid, text and token count), where
        given, from its wire fields. Once the read that brought it is handed out, `write` is
        called with a nudge: what it calls when it cannot write, so the handler writes (and
        meets the error or the slow client itself)."""
        self._take, self._write, self._take_text = take, write, take_text
        if take_text is not None and not self.resumed:
            for rid in self.index:
                self.reader.set_sink(rid, functools.partial(self._relayed_text, rid))

    def _relayed(self, reply: Any) -> bool:
        """Whether the relay took `reply` (handled as `replies` would have yielded it)."""
        take = self._take
        if take is None or not self._waiting or not self.queue.empty():
            return False  # not waiting, or replies queued before it: in order, by the handler
        if not isinstance(reply, TextDelta) or reply.finish is not None:
            return False  # a terminal reply ends the handler's loop
        try:
            if not take(reply):
                return False
            self._received(reply)
            self._note(reply)
        except Exception as exc:  # the handler's to answer (not the reader's, all streams')
            asyncio.Queue.put_nowait(self.queue, Failed(exc))
            return True
        self._write_soon()
        return True

    def _relayed_text(self, rid: str, text: str | None, count: int) -> bool:
        """`_relayed` for a delta of text alone, from its fields (the reader's sink): what
        `_received` and `_note` note of one, in one call (a relayed delta's calls are most
        of what it costs the ingress)."""
        take = self._take_text
        if take is None or not self._waiting or not self.queue.empty():
            return False
        try:
            if not take(rid, text, count):
                return False
            self._last_reply = time.monotonic()
            if self._charges_tokens:
                self._charge(rid, count)
            self._time_tokens(rid, count, finished=False)
        except Exception as exc:
            asyncio.Queue.put_nowait(self.queue, Failed(exc))
            return True
        self._write_soon()
        return True

    def _write_soon(self) -> None:
        if not self._write_due:
            self._write_due = True
            self.reader.after_read(self._written)

    def _written(self) -> None:
        self._write_due = False
        if self._write is not None:
            self._write(self._nudge)

    def _nudge(self) -> None:
        asyncio.Queue.put_nowait(self.queue, NUDGE)

    def _watch(self) -> None:
        """Time out the wait if no reply came for reply_timeout_s (replies queued, not yet
        read, are not silence); else look again then."""
        silent = time.monotonic() - self._last_reply
        timeout = self.state.config.reply_timeout_s
        if silent >= timeout and self.queue.empty():
            self._watchdog = None
            self.queue.put_nowait(TIMED_OUT)
        else:
            wait = max(timeout - silent, 0.01)
            self._watchdog = asyncio.get_running_loop().call_later(wait, self._watch)

    def _timed_out(self) -> ErrorReply:
        rid = next(r.rid for r in self.requests if r.rid not in self.finished)
        timeout = self.state.config.reply_timeout_s
        return ErrorReply(rid, 504, f"no reply for {timeout:g} s: the request was aborted",
                          "timeout", None, "reply_timeout")  # fmt: skip

    def _note(self, reply: Reply) -> None:
        if is_terminal(reply):
            self.finished.add(reply.rid)
        self._charge_reply(reply)
        if isinstance(reply, TextDelta) and not self.resumed:  # a replay would count twice
            self._time_tokens(reply.rid, reply.count, reply.finish is not None)

    def _charge_reply(self, reply: Reply) -> None:
        """Charge a reply's new tokens; on a sub-request's last, what its Finish counts
        beyond what was charged already (the prompt, unless it came as token ids)."""
        if not isinstance(reply, TextDelta):
            return
        finish = reply.finish_info()
        if finish is None:
            self._charge(reply.rid, reply.count)
        else:
            used = finish.prompt_tokens + finish.completion_tokens
            self._charge(reply.rid, used - self._charged.get(reply.rid, 0))

    def _charge(self, rid: str, tokens: int) -> None:
        if self._charges_tokens and tokens > 0:
            assert self.tenant is not None
            self._charged[rid] = self._charged.get(rid, 0) + tokens
            self.state.tenant_limits.charge(self.tenant, tokens)

    def _time_tokens(self, rid: str, count: int, finished: bool) -> None:
        """A delta of `count` tokens of `rid` came now (its last, if `finished`)."""
        metrics = self.state.metrics
        now = time.monotonic()
        if count:
            last = self._last_token_at.get(rid)
            if last is None:
                now = self.first_token_at.setdefault(rid, now)
                metrics.token_times(True, now - self._arrived, count)
            else:
                metrics.token_times(False, now - last, count)
            self._last_token_at[rid] = now
        if finished:
            metrics.request_ended(now - self._arrived)

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
