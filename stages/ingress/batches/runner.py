"""Runs OpenAI batches (batch_store/batches.py): every ingress replica runs one `BatchRunner`.

A runner takes a batch with a lease in Redis, renewed every poll, and runs its lines as the
ingress runs a request answered whole (handlers.answer_whole): through the same checks, the
same pipeline and the same response bodies, at most ``batch_concurrency`` lines at once.
Each line's result is recorded once in Redis as it finishes. A line runs as its batch's
owner: its key's tenant (weight and limits) and owner (who may abort it). When an ingress dies its
leases lapse and another replica's runner takes its batches: it aborts the requests the dead
one had running, and runs every line without a result, so a line is answered exactly once.

A 429 or 503 on admission (queue full, no live worker) is not the line's answer: the line
waits and tries again, so a batch rides out a busy or restarting deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from batch_store.batches import BATCH_PRIORITY, BatchStore, error_line, result_line
from batch_store.input_file import BatchLine, parse_input
from bus.aborts import publish_aborts_async
from bus.reconnect import REDIS_TRANSIENT
from jobs.errors import RequestError
from stages.ingress.api import handlers
from stages.ingress.api.openai_format import ChatFormat, CompletionFormat
from stages.ingress.api.params import parse_chat, parse_completion
from stages.ingress.errors import error_body
from stages.ingress.state import IngressState
from stages.ingress.tenancy.tenants import DEFAULT_PRIORITY, Tenant

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a runner looks for batches, renews its leases, sees cancels
RETRY_S = (0.25, 0.5, 1.0, 2.0)  # waits before a line tries admission again
MAX_BATCHES = 4  # batches one runner runs at once
RERUNS = 3  # passes over lines whose results a restarted Redis lost, before ending anyway
T = TypeVar("T")
_TEXT_FIELDS = ("input_file_id", "endpoint", "status")  # what a runner reads of a batch


class BatchRunner:
    def __init__(self, state: IngressState) -> None:
        assert state.home_sync_redis is not None
        self.state = state
        self.config = state.config
        # Batches live on the home shard; their lines run on this replica's (shards.py).
        self.store = BatchStore(state.home_sync_redis, state.shards.home.config)
        self.owner = f"{state.frontend_id}-{uuid.uuid4().hex[:8]}"
        self.lease_ms = int(self.config.batch_lease_s * 1000)
        self.batches: dict[str, asyncio.Task[None]] = {}

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking store call, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def run(self) -> None:
        """Take, renew and run batches until cancelled; then let go of them."""
        try:
            while True:
                try:
                    await self._poll()
                except REDIS_TRANSIENT as exc:
                    logger.warning("batch runner: Redis unreachable: %s", exc)
                except Exception:  # the next poll tries again: a runner that ended runs none
                    logger.exception("batch runner: a poll failed")
                await asyncio.sleep(POLL_S)
        finally:
            for task in self.batches.values():
                task.cancel()
            await asyncio.gather(*self.batches.values(), return_exceptions=True)
            for batch_id in list(self.batches):
                with contextlib.suppress(redis.RedisError):
                    await self._call(self.store.release_lease, batch_id, self.owner)

    async def _poll(self) -> None:
        for batch_id, task in list(self.batches.items()):
            if task.done():
                del self.batches[batch_id]
            elif not await self._call(self.store.renew_lease, batch_id, self.owner, self.lease_ms):
                logger.warning("batch %s: lease lost; leaving it to its new runner", batch_id)
                task.cancel()
                del self.batches[batch_id]
        for batch_id in await self._call(self.store.active_ids):
            if len(self.batches) >= MAX_BATCHES:
                break
            if batch_id in self.batches:
                continue
            if await self._call(self.store.take_lease, batch_id, self.owner, self.lease_ms):
                task = asyncio.get_running_loop().create_task(self._run_batch(batch_id))
                self.batches[batch_id] = task

    async def _run_batch(self, batch_id: str) -> None:
        try:
            await self._batch(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Its lease lapses and a runner tries again; the lines done stay done.
            logger.exception("batch %s: its runner failed", batch_id)
            await asyncio.sleep(self.config.batch_lease_s)
        else:
            with contextlib.suppress(redis.RedisError):
                await self._call(self.store.release_lease, batch_id, self.owner)

    async def _batch(self, batch_id: str) -> None:
        obj = await self._readable(batch_id)
        if obj is None:
            return
        try:
            # A file deleted before its batch ran fails the batch, as one that is no batch.
            content = await self._call(self.store.files.content, obj["input_file_id"])
            lines, bad = parse_input(content, obj["endpoint"], self.config.max_batch_lines,
                                     self.config.max_batch_line_bytes)  # fmt: skip
        except RequestError as exc:
            await self._call(self.store.fail, batch_id, exc)
            return
        if obj["status"] == "validating":
            errors = {e.line: error_line(e.custom_id, e.code, e.message) for e in bad}
            await self._call(self.store.begin, batch_id, len(lines) + len(bad), errors)
        stale = await self._call(self.store.stale_requests, batch_id)
        if stale:  # an earlier runner's requests: stop them, their lines run again here
            rids = [rid for _, rids in stale for rid in rids]
            for shard in self.state.shards.all:  # that runner's replica's shard, unknown here
                await publish_aborts_async(shard.redis, shard.config, rids)
        done = await self._call(self.store.done_lines, batch_id)
        todo = [line for line in lines if line.line not in done]
        logger.info("batch %s: %d of %d lines to run", batch_id, len(todo), len(lines))
        status = await self._lines(batch_id, obj, todo)
        for _ in range(RERUNS):
            # Redis started again from its append-only file (fsynced every second) may have
            # lost the results of the last lines it took before it died: every line ran,
            # yet some have none. Those run again, or the batch would end short of them.
            done = await self._call(self.store.done_lines, batch_id)
            todo = [line for line in lines if line.line not in done]
            if status != "completed" or not todo:
                break
            logger.warning("batch %s: %d lines have no result after running (Redis lost "
                           "them?): running them again", batch_id, len(todo))  # fmt: skip
            status = await self._lines(batch_id, obj, todo)
        await self._call(self.store.finish, batch_id, status)
        logger.info("batch %s: %s", batch_id, status)

    async def _readable(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's object, or None (and out of the runners' set) where there is none to
        run: its key gone, or holding what no store wrote. Else every runner would take it,
        fail and take it again each lease, for ever."""
        try:
            obj = await self._call(self.store.raw, batch_id)
            texts = all(isinstance(obj.get(key), str) for key in _TEXT_FIELDS)
            if texts and isinstance(obj.get("expires_at"), (int, float)):
                return obj
            reason: object = "fields missing"
        except REDIS_TRANSIENT:
            raise
        except Exception as exc:  # not found (an ApiError), not JSON, not a JSON object
            reason = exc
        logger.warning("batch %s: no batch object to run (%s); dropped", batch_id, reason)
        await self._call(self.store.retire_unreadable, batch_id)
        return None

    async def _lines(self, batch_id: str, obj: dict[str, Any], todo: list[BatchLine]) -> str:
        """Run `todo`, a window at a time, until done, cancelled or expired: which one."""
        window = asyncio.Semaphore(self.config.batch_concurrency)
        running: set[asyncio.Task[None]] = set()
        ending = asyncio.get_running_loop().create_task(self._ended(batch_id, obj))

        async def feed() -> None:
            for line in todo:
                await window.acquire()
                task = asyncio.get_running_loop().create_task(self._line(batch_id, obj, line))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), window.release()))
            while running:
                await asyncio.wait(set(running))

        feeding = asyncio.get_running_loop().create_task(feed())
        try:
            await asyncio.wait({feeding, ending}, return_when=asyncio.FIRST_COMPLETED)
            if ending.done():
                for task in [feeding, *running]:
                    task.cancel()  # each line's submission aborts its requests on the way out
                await asyncio.gather(feeding, *running, return_exceptions=True)
                return ending.result()
            feeding.result()
            return "completed"
        finally:
            ending.cancel()
            feeding.cancel()

    async def _ended(self, batch_id: str, obj: dict[str, Any]) -> str:
        """Returns once the batch is cancelled ("cancelled") or past its window ("expired")."""
        while True:
            await asyncio.sleep(POLL_S)
            if time.time() >= obj["expires_at"]:
                return "expired"
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                if (await self._call(self.store.raw, batch_id))["status"] == "cancelling":
                    return "cancelled"

    async def _line(self, batch_id: str, obj: dict[str, Any], line: BatchLine) -> None:
        chat = obj["endpoint"] == "/v1/chat/completions"
        fmt = ChatFormat() if chat else CompletionFormat()
        tenant = self.state.tenants.named(obj.get("tenant"))  # whose key made the batch
        try:
            job = (parse_chat if chat else parse_completion)(line.body, self.state.model)
            # Within the owner's range (a 403 below it), then at 1 or above: after interactive.
            asked = tenant.priority_of(job.sampling.get("priority"))
            job.sampling["priority"] = max(BATCH_PRIORITY, asked or DEFAULT_PRIORITY)
            await job.compile_grammar()
        except RequestError as exc:
            result, ok = result_line(line.custom_id, exc.status, error_body(exc)), False
        else:
            result, ok = await self._answer(batch_id, line, job, fmt, tenant, obj.get("owner"))
        await self._call(self.store.record, batch_id, line.line, result, ok)

    async def _answer(
        self, batch_id: str, line: BatchLine, job, fmt, tenant: Tenant, owner: str | None
    ) -> tuple[dict, bool]:
        """The line's result, waiting out a full queue, its tenant's limits, no live worker
        or a Redis outage."""
        attempt = 0
        while True:
            request_id = fmt.id_prefix + uuid.uuid4().hex
            rids = job.rids(request_id)
            try:
                await self._call(self.store.running, batch_id, line.line, request_id, rids)
                body = await handlers.answer_whole(self.state, job, fmt, request_id, tenant,
                                                   owner)  # fmt: skip
                return result_line(line.custom_id, 200, body), True
            except RequestError as exc:
                if exc.status not in (429, 503):
                    return result_line(line.custom_id, exc.status, error_body(exc)), False
            except REDIS_TRANSIENT as exc:
                logger.debug("batch %s line %d: Redis unreachable: %s", batch_id, line.line, exc)
            await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
            attempt += 1
