"""Reading a reply stream: each request's TextDelta / ErrorReply messages, in order.

An entry holds one message, or a TextDeltas bundle of the deltas one detokenizer batch had
for this stream (jobs that asked for ``bundle_replies``, as the ingress and `Client` do):
the router (bus/reply_router.py) takes a bundle apart and files each delta as if it came
alone, named by its rid or by the tag its job was given (bus/reply_tags.py).

A frontend (an ingress replica, a direct client) owns one reply stream, named in the
``reply_to`` of every job it submits. Detokenizer replicas race, so the deltas of one request
can land out of order or twice: `ReplyOrderer` (bus/reply_order.py) puts them back in output
order by ``TextDelta.seq`` (the output index of the delta's first token) and drops copies. One task
(`AsyncReplyReader`) or one thread at a time (`ReplyReader`) reads the stream and hands each
registered request its messages; rids nobody registered are replies to requests that were
aborted or given up on, and are dropped.

The reply stream's name is unique to its reader, so everything on it is the reader's: the
reader starts from the stream's beginning rather than from ``$``, which would miss a reply
landing between a submit and the first XREAD.

No writer caps a reply stream's length: a cap by count would cut replies the reader has not
read yet, or the history a resumed stream replays. Its reader trims it (`trim_point`) and it
expires ``reply_ttl_s`` after its expiry's last renewal (a live ingress renews it; at least
3/4 of it after its last write), so what a dead reader leaves goes too; Redis's
``maxmemory`` bounds the rest.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aredis

from bus.async_pool import pack, send_packed
from bus.reconnect import RECONNECT_BACKOFF_S, REDIS_TRANSIENT
from bus.reply_order import Reply
from bus.reply_router import (
    BLOCK_MS,
    READ_COUNT,
    ReplyRouter,
    Sink,
    raw_stream_entries,
    stream_entries,
)
from jobs.protocol import ErrorReply, Message, TextDelta

logger = logging.getLogger(__name__)


def is_terminal(message: Message) -> bool:
    return isinstance(message, ErrorReply) or (
        isinstance(message, TextDelta) and message.finish is not None
    )


def lost_bus_reply(rid: str, exc: Exception) -> ErrorReply:
    """What a waiting request gets when its replies can no longer be read."""
    return ErrorReply(rid, 503, f"lost the connection to Redis: {exc}", "service_unavailable",
                      None, "redis_unavailable")  # fmt: skip


class _StreamReader:
    """What both readers hold: their Redis client, the reply stream, and the `ReplyRouter`
    that reads it (XREAD of `count` entries, blocking `block_ms`) and files each rid's
    replies."""

    def __init__(
        self, client: Any, stream: str, *, block_ms: int = BLOCK_MS, count: int = READ_COUNT
    ) -> None:
        self.client = client
        self.stream = stream
        self._router = ReplyRouter(stream, block_ms=block_ms, count=count)


class AsyncReplyReader(_StreamReader):
    """One task reading the reply stream; each rid's in-order messages go to its queue.

    Register a rid (with the queue to fill; several rids may share one) before submitting its
    job. A rid is forgotten after its terminal message. If Redis cannot be read, every waiting
    rid gets a 503 ErrorReply rather than waiting forever, and the reader keeps retrying.
    """

    client: aredis.Redis

    def __init__(
        self, client: aredis.Redis, stream: str, *, trim: bool = True, **read: int
    ) -> None:
        """`read`: `_StreamReader`'s block_ms and count."""
        super().__init__(client, stream, **read)
        self.trim = trim  # False: a stream this reader does not own (a resumed one)
        self._queues: dict[str, asyncio.Queue[Reply]] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._after_read: list[Callable[[], None]] | None = None  # a list while handing out

    def register(self, rid: str, queue: asyncio.Queue[Reply] | None = None) -> asyncio.Queue[Reply]:
        queue = queue if queue is not None else asyncio.Queue()
        self._router.register(rid)
        self._queues[rid] = queue
        return queue

    def unregister(self, rid: str) -> None:
        self._router.unregister(rid)
        self._queues.pop(rid, None)

    def set_sink(self, rid: str, sink: Sink | None) -> None:
        """Hand registered `rid`'s plain deltas to `sink` as they are read, not to its queue
        (bus/reply_router.py says which and when); None: to its queue again."""
        self._router.set_sink(rid, sink)

    def tag(self, rid: str) -> int:
        """A tag for registered `rid`, for its job (bus/reply_tags.py)."""
        return self._router.tag(rid)

    def after_read(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the read being handed out is (a queue that handles messages
        as they come writes then, once per read); soon, if no read is being handed out."""
        if self._after_read is None:
            asyncio.get_running_loop().call_soon(callback)
        else:
            self._after_read.append(callback)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.stream)

    async def close(self, delete_stream: bool = True) -> None:
        """Stop reading and (by default) delete the reply stream."""
        task, self._task = self._task, None
        self._closing = True
        if task is not None:
            task.cancel()
            # redis-py can swallow a cancellation that lands while it connects
            # (redis/redis-py#2028); the loop then stops when its XREAD returns.
            await asyncio.wait([task], timeout=self._router.block_ms / 1000 + 1)
        if delete_stream:
            try:
                await self.client.delete(self.stream)
            except REDIS_TRANSIENT as exc:
                logger.warning("%s: could not delete the reply stream: %s", self.stream, exc)

    async def _run(self) -> None:
        # Its reads hold a connection of their own (given back at the end), and go through
        # it rather than the client: the pool's lock and check per read, and the client's
        # command machinery and reply parsing, were a quarter of what a read cost.
        connection, failures = None, 0
        try:
            while not self._closing:
                try:
                    if connection is None:
                        connection = await self.client.connection_pool.get_connection()
                    args = self._router.read_args()
                    await send_packed(connection, pack(connection, [(
                        "XREAD", "COUNT", args["count"], "BLOCK", args["block"],
                        "STREAMS", self.stream, self._router.last_id,
                    )]))  # fmt: skip
                    entries = raw_stream_entries(await connection.read_response())
                    failures = 0
                except REDIS_TRANSIENT as exc:
                    delay = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
                    failures += 1
                    logger.warning(
                        "%s: Redis unreachable (%s); retrying in %.1f s", self.stream, exc, delay
                    )
                    self._fail_all(exc)
                    await asyncio.sleep(delay)
                    continue
                except Exception as exc:  # a dead reader would leave every request hanging
                    logger.exception("%s: reading replies failed", self.stream)
                    self._fail_all(exc)
                    await asyncio.sleep(RECONNECT_BACKOFF_S[-1])
                    continue
                self._hand_out(entries)
                if self.trim:
                    await self._trim()
        finally:
            if connection is not None:
                await self.client.connection_pool.release(connection)

    def _hand_out(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        self._after_read = after = []  # the sinks' calls, in routing, are of this read too
        try:
            for rid, message in self._router.route(entries):
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(message)
                if is_terminal(message):
                    self._queues.pop(rid, None)
        finally:
            self._after_read = None
            for callback in after:
                try:
                    callback()
                except Exception:  # one's failure must not stop the others' replies
                    logger.exception("%s: a callback after a read failed", self.stream)

    def _fail_all(self, exc: Exception) -> None:
        for rid in self._router.rids():
            queue = self._queues.pop(rid, None)
            self._router.unregister(rid)
            if queue is not None:
                queue.put_nowait(lost_bus_reply(rid, exc))

    async def _trim(self) -> None:
        trim_to = self._router.trim_point()
        if trim_to is None:
            return
        try:
            await self.client.xtrim(self.stream, minid=trim_to, approximate=True)
        except REDIS_TRANSIENT:
            pass  # the next read reports it


class ReplyReader(_StreamReader):
    """The blocking counterpart of `AsyncReplyReader`, for the sync client.

    No thread of its own: whichever caller of `get` finds nobody reading does one XREAD
    (outside the lock) and files what it read; the others wait on the condition. So several
    threads may wait on different rids of one reader.
    """

    client: redis.Redis

    def __init__(self, client: redis.Redis, stream: str, **read: int) -> None:
        """`read`: `_StreamReader`'s block_ms and count."""
        super().__init__(client, stream, **read)
        self._buffers: dict[str, collections.deque[Reply | None]] = {}
        self._cond = threading.Condition()
        self._reading = False

    def register(self, rid: str) -> None:
        with self._cond:
            self._router.register(rid)
            self._buffers[rid] = collections.deque()

    def tag(self, rid: str) -> int:
        """A tag for registered `rid`, for its job (bus/reply_tags.py)."""
        with self._cond:
            return self._router.tag(rid)

    def cancel(self, rid: str) -> None:
        """Stop routing `rid`'s replies; its reader gets None next (unread replies dropped)."""
        with self._cond:
            self._router.unregister(rid)
            buffer = self._buffers.get(rid)
            if buffer is not None:
                buffer.clear()
                buffer.append(None)
            self._cond.notify_all()

    def get(self, rid: str, timeout: float | None = None) -> Reply | None:
        """The next in-order message of `rid`; None once it is cancelled.

        Raises KeyError for an unknown rid and TimeoutError after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                buffer = self._buffers.get(rid)
                if buffer is None:
                    raise KeyError(f"unknown or finished request {rid!r}")
                if buffer:
                    message = buffer.popleft()
                    if message is None or is_terminal(message):
                        self._buffers.pop(rid, None)
                    return message
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no reply for {rid!r} within {timeout} s")
                if self._reading:
                    self._cond.wait(remaining)
                    continue
                self._reading = True
            self._read_once(remaining)

    def _read_once(self, remaining: float | None) -> None:
        try:
            response = self.client.xread(**self._router.read_args(remaining))
        except BaseException:
            with self._cond:
                self._reading = False
                self._cond.notify_all()
            raise
        with self._cond:
            # Filed before another thread may read, so no entry is read twice.
            for rid, message in self._router.route(stream_entries(response)):
                buffer = self._buffers.get(rid)
                if buffer is not None:
                    buffer.append(message)
            self._reading = False
            self._cond.notify_all()
            trim_to = self._router.trim_point()
        if trim_to is not None:
            self.client.xtrim(self.stream, minid=trim_to, approximate=True)

    def close(self, delete_stream: bool = True) -> None:
        if delete_stream:
            try:
                self.client.delete(self.stream)
            except REDIS_TRANSIENT as exc:
                logger.warning("%s: could not delete the reply stream: %s", self.stream, exc)
