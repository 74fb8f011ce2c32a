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

from bus.reconnect import REDIS_TRANSIENT
from bus.replies import AsyncReplyReader
from jobs.protocol import GenerateRequest
from jobs.request_normaliser import ModelLimits
from runtime.config import BusConfig
from stages.ingress.errors import ApiError
from stages.ingress.health import QueueDepth, WorkerHealth
from stages.ingress.metrics import IngressMetrics
from stages.ingress.request_writes import RequestWrites
from stages.ingress.shards import Shard, Shards
from stages.ingress.tenancy.limits import TenantLimits
from stages.ingress.tenancy.ownership import read_request_record, request_record, sees
from stages.ingress.tenancy.tenants import Tenant, Tenants

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
    queue: QueueDepth
    openapi: dict[str, Any]
    metrics: IngressMetrics
    tenants: Tenants
    tenant_limits: TenantLimits
    shards: Shards  # `redis` and `config` are its own shard's (stages/ingress/shards.py)
    sync_redis: redis.Redis | None = None  # for the metrics' threads; set at start-up
    # Blocking clients of the other shards, by tag, set at start-up (`sync_shards`).
    other_sync_redis: dict[str | None, redis.Redis] = field(default_factory=dict)
    deployment_metrics: Any = None  # the registry /metrics renders, made at its first scrape
    metrics_publisher: Any = None  # observability.metrics.MetricsPublisher, None with metrics off
    started: int = field(default_factory=lambda: int(time.time()))
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # Dropped requests' last replies being awaited to charge them (cancelled at shutdown).
    settling: set[asyncio.Task[None]] = field(default_factory=set)
    draining: bool = False  # SIGTERM: streams cut now are left running, to be resumed
    handed_over: int = 0  # such streams
    # Sub-requests admitted here against a tenant's limits (rid -> tenant): the running
    # slots this replica renews.
    running_tenants: dict[str, Tenant] = field(default_factory=dict)
    # Requests submitted here and not yet done: their request keys are renewed.
    live_requests: set[str] = field(default_factory=set)
    # Their starts and ends, per shard (request_writes.py).
    request_writes: dict[str | None, RequestWrites] = field(default_factory=dict)
    # What this replica knows of the model: its context length where the model's files are
    # on this host (runtime/context_length.py), to check prompts of token ids against.
    limits: ModelLimits = field(default_factory=ModelLimits)

    @property
    def reply_stream(self) -> str:
        return self.replies.stream

    @property
    def sync_shards(self) -> list[tuple[redis.Redis, BusConfig]]:
        """A blocking client of every shard, in the shards' order, with its names: for
        /metrics, /status, and the home shard's files and batches."""
        assert self.sync_redis is not None
        return [(self.sync_redis if shard is self.shards.own
                 else self.other_sync_redis[shard.config.shard], shard.config)
                for shard in self.shards.all]  # fmt: skip

    @property
    def home_sync_redis(self) -> redis.Redis | None:
        """The home shard's blocking client (stages/ingress/shards.py)."""
        if self.shards.home is self.shards.own:
            return self.sync_redis
        return self.other_sync_redis.get(self.shards.home.config.shard)

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
        depth = await self.queue.depth()
        if depth >= self.max_queue:
            raise ApiError(
                429,
                f"the queue is full ({depth} jobs waiting); retry later",
                "rate_limit_exceeded",
                None,
                "queue_full",
                headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
            )

    async def submit(
        self, request_id: str, requests: Sequence[GenerateRequest], owner: str | None = None
    ) -> None:
        """Queue the request's jobs (a prompt of token ids for the router, the others for the
        tokenizer: request_writes.py), recorded with their `owner` (tenancy/ownership.py),
        all or none: in a MULTI (with the other requests of this turn: request_writes.py),
        so a Redis that fills up midway (OOM) leaves no choice running that its 503 said
        was refused."""
        record = request_record(len(requests), owner)
        await self.writes(self.shards.own).start(request_id, record, requests)
        self.queue.queued(len(requests))

    def writes(self, shard: Shard) -> RequestWrites:
        """The requests' starts and ends on `shard`, gathered per turn."""
        writes = self.request_writes.get(shard.config.shard)
        if writes is None:
            writes = self.request_writes[shard.config.shard] = RequestWrites(
                shard.redis, shard.config, self.limits
            )
        return writes

    async def renew_keys(self) -> None:
        """Renew the TTL of this replica's reply stream and of its live requests' keys."""
        ttl = self.config.reply_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        pipe.expire(self.reply_stream, ttl)
        for request_id in self.live_requests:
            pipe.expire(self.config.request_key(request_id), ttl)
        await pipe.execute()

    def release_soon(self, tenant: Tenant, rids: list[str]) -> None:
        """Free the sub-requests' slots in their tenant's limits, and send the tokens it
        was charged."""
        self._in_background(self._release(tenant, rids))

    async def _release(self, tenant: Tenant, rids: list[str]) -> None:
        try:
            await self.tenant_limits.release(tenant, rids)
        except REDIS_TRANSIENT as exc:
            # The slots' leases end on their own (tenant_limits.LEASE_S); the tokens are
            # sent with the next flush.
            logger.warning("could not release %d slots: %s", len(rids), exc)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def settle_soon(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a dropped request's charging to its end (Submission._settle); unlike the
        other background work, shutdown does not wait for it."""
        task = asyncio.get_running_loop().create_task(work)
        self.settling.add(task)
        task.add_done_callback(self.settling.discard)

    def finish_soon(
        self,
        request_id: str,
        unfinished: list[str],
        shard: Shard | None,
        workers: dict[str, str] | None = None,
    ) -> None:
        """Forget `request_id` and abort its `unfinished` sub-requests on the shard it was
        submitted to (None: this replica's), with the other ends of this turn, from a task
        of their own: the handler asking may be being cancelled. `workers`: those known to
        be running on a worker (bus/aborts.py tells it at once)."""
        self.writes(shard or self.shards.own).end(request_id, unfinished, workers or {})

    async def sub_requests(
        self, request_id: str, caller: str | None = None
    ) -> tuple[Shard, list[str]] | None:
        """The shard and rids of a request some ingress replica is serving for `caller`'s
        owner: all of them for its id, one for a sub-request's rid; None if it is unknown,
        done or another owner's."""
        found = await self.shards.read(lambda config: config.request_key(request_id))
        if found is not None:
            count, owner = read_request_record(found[1])
            rids = [f"{request_id}-{i}" for i in range(count)]
            return (found[0], rids) if sees(caller, owner) else None
        parent, _, index = request_id.rpartition("-")
        if parent and index.isdigit():
            found = await self.shards.read(lambda config: config.request_key(parent))
            if found is not None:
                count, owner = read_request_record(found[1])
                if int(index) < count and sees(caller, owner):
                    return found[0], [request_id]
        return None

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": self.started,
            "owned_by": "streamserve",
        }


STATE = web.AppKey("streamserve_ingress", IngressState)
