"""What the handlers of one ingress replica share: its Redis client, reply reader, figures.

A request's keys live as long as the request: its request key is set with ``reply_ttl_s``
and, like this replica's reply stream, renewed every quarter of that while it runs
(`renew_keys`, one pipeline for all of them), so a job longer than the TTL keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aredis
from aiohttp import web

from bus.aborts import publish_aborts_async
from bus.client import add_requests
from bus.config import BusConfig
from bus.protocol import GenerateRequest
from bus.reconnect import REDIS_TRANSIENT
from bus.replies import AsyncReplyReader
from stages.ingress.errors import ApiError
from stages.ingress.health import WorkerHealth, queue_depth
from stages.ingress.metrics import IngressMetrics
from stages.ingress.tenant_limits import TenantLimits
from stages.ingress.tenants import Tenant, Tenants

logger = logging.getLogger(__name__)

QUEUE_FULL_RETRY_AFTER_S = 1
# A running request's keys are renewed this many times per TTL: a missed renewal or two
# (Redis briefly away) still leaves them alive.
RENEWALS_PER_TTL = 4


@dataclass
class IngressState:
    config: BusConfig
    model: str
    frontend_id: str
    max_queue: int
    redis: aredis.Redis
    replies: AsyncReplyReader
    health: WorkerHealth
    openapi: dict[str, Any]
    metrics: IngressMetrics
    tenants: Tenants
    tenant_limits: TenantLimits
    sync_redis: redis.Redis | None = None  # for the metrics' threads; set at start-up
    deployment_metrics: Any = None  # the registry /metrics renders, made at its first scrape
    metrics_publisher: Any = None  # bus.metrics.MetricsPublisher, None with metrics off
    started: int = field(default_factory=lambda: int(time.time()))
    background: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False  # SIGTERM: streams cut now are left running, to be resumed
    handed_over: int = 0  # such streams
    # Requests admitted here against a tenant's limits, whose running slots it renews.
    running_tenants: dict[str, Tenant] = field(default_factory=dict)
    # Requests submitted here and not yet done: their request keys are renewed.
    live_requests: set[str] = field(default_factory=set)

    @property
    def reply_stream(self) -> str:
        return self.replies.stream

    async def admit(self, count: int) -> None:
        """Refuse new work with 503 while no worker is alive, 429 while the queue is full."""
        if not await self.health.may_serve():
            raise ApiError(
                503,
                "no live worker to serve the request; try again later",
                "service_unavailable",
                None,
                "no_worker",
            )
        depth = await queue_depth(self.redis, self.config)
        if depth >= self.max_queue:
            raise ApiError(
                429,
                f"the queue is full ({depth} jobs waiting); retry later",
                "rate_limit_exceeded",
                None,
                "queue_full",
                headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
            )

    async def submit(self, request_id: str, requests: Sequence[GenerateRequest]) -> None:
        """Queue the request's jobs, all or none: a MULTI, so a Redis that fills up midway
        (OOM) leaves no choice running that its 503 said was refused."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.config.request_key(request_id), len(requests), ex=self.config.reply_ttl_s)
        add_requests(pipe, self.config, requests)
        await pipe.execute()

    async def renew_keys(self) -> None:
        """Renew the TTL of this replica's reply stream and of its live requests' keys."""
        ttl = self.config.reply_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        pipe.expire(self.reply_stream, ttl)
        for request_id in self.live_requests:
            pipe.expire(self.config.request_key(request_id), ttl)
        await pipe.execute()

    def release_soon(self, tenant: Tenant, request_id: str, tokens: int) -> None:
        """Free the request's slot in its tenant's limits, and count its tokens."""
        self._in_background(self._release(tenant, request_id, tokens))

    async def _release(self, tenant: Tenant, request_id: str, tokens: int) -> None:
        try:
            await self.tenant_limits.release(tenant, request_id, tokens)
        except REDIS_TRANSIENT as exc:
            # Its slot's lease ends on its own (tenant_limits.LEASE_S).
            logger.warning("could not release %s's slot: %s", request_id, exc)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def finish_soon(self, request_id: str, unfinished: list[str]) -> None:
        """Forget `request_id` and abort its `unfinished` sub-requests, from a task of its
        own: the handler asking may be being cancelled."""
        self._in_background(self._finish(request_id, unfinished))

    async def _finish(self, request_id: str, unfinished: list[str]) -> None:
        try:
            await self.redis.delete(self.config.request_key(request_id))
            if unfinished:
                await publish_aborts_async(self.redis, self.config, unfinished)
                logger.debug("aborted %s", unfinished)
        except REDIS_TRANSIENT as exc:
            logger.warning("could not abort %d requests: %s", len(unfinished), exc)

    async def sub_requests(self, request_id: str) -> list[str]:
        """The rids of a request some ingress replica is serving: all of them for its id,
        one for a sub-request's rid; none if it is unknown or done."""
        count = await self.redis.get(self.config.request_key(request_id))
        if count is not None:
            return [f"{request_id}-{i}" for i in range(int(count))]
        parent, _, index = request_id.rpartition("-")
        if parent and index.isdigit():
            count = await self.redis.get(self.config.request_key(parent))
            if count is not None and int(index) < int(count):
                return [request_id]
        return []

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": self.started,
            "owned_by": "streamserve",
        }


STATE = web.AppKey("streamserve_ingress", IngressState)
