"""The ingress app and `run`, what ``streamserve stage ingress`` calls.

Each replica has a unique frontend id and its own reply stream ``<p>:reply:<frontend id>``,
named in the ``reply_to`` of every job it submits; one task reads it for every open request.
Replicas on one host share the port (SO_REUSEPORT), and the kernel spreads connections.
Handlers are cancelled when their client disconnects (``handler_cancellation``), which is
what aborts the client's requests. A client gets ``ingress_header_timeout_s`` to send a
request's head and ``ingress_body_timeout_s`` its body, and a replica serves at most
``ingress_max_connections`` connections at once (stages/ingress/connections.py). SIGTERM
stops accepting and gives in-flight requests ``SHUTDOWN_TIMEOUT_S``; a stream cut then is
handed over, not aborted: it runs on, its history stays on this replica's reply stream, and
its client resumes it on another replica with ``Last-Event-ID`` (streaming/resume.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Sequence

import redis
from aiohttp import web

from bus.actor import unique_consumer_name
from bus.async_pool import async_redis
from bus.reconnect import REDIS_TRANSIENT
from bus.replies import AsyncReplyReader
from jobs.request_normaliser import ModelLimits
from observability.metrics import start_publisher
from runtime import event_loop
from runtime.config import BusConfig
from runtime.context_length import context_length_if_known
from runtime.gc_tuning import settle_heap
from runtime.task_cancel import cancel_and_wait
from stages.ingress.api import admin_weights, handlers, service_endpoints
from stages.ingress.api.embeddings import embeddings
from stages.ingress.api.openapi import openapi_document
from stages.ingress.batches import routes as batch_api
from stages.ingress.batches.runner import BatchRunner
from stages.ingress.connections import BODY_TIMEOUT_S, BadRequestLog, CappedSite, body_deadline
from stages.ingress.errors import Handler, error_middleware
from stages.ingress.health import QueueDepth, WorkerHealth
from stages.ingress.metrics import IngressMetrics
from stages.ingress.responses import routes as responses_api
from stages.ingress.shards import Shards
from stages.ingress.state import RENEWALS_PER_TTL, STATE, IngressState
from stages.ingress.status_page import status_json, status_page
from stages.ingress.streaming.resume import announce_alive
from stages.ingress.tenancy.auth import KEYS_CHECKED, api_keys_from_env, auth_middleware
from stages.ingress.tenancy.limits import CHARGE_INTERVAL_S, LEASE_S, TenantLimits
from stages.ingress.tenancy.tenants import Tenants, tenants_from_env

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MAX_QUEUE = 10_000
# In-flight requests get this long to finish on SIGTERM (the launcher waits 15 s in all).
SHUTDOWN_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0
# Above the reply reader's blocking XREAD (1 s), so only a hung server times out.
SOCKET_TIMEOUT_S = 10.0


def create_app(
    config: BusConfig,
    *,
    model: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
    frontend_id: str | None = None,
    api_keys: Sequence[str] = (),
    admin_keys: Sequence[str] = (),
    tenants: Tenants | None = None,
    context_length: int | None = None,
) -> web.Application:
    """The app; serve it with ``web.AppRunner(app, handler_cancellation=True)``.

    `context_length`: the model's, that prompts of token ids are checked against before
    they go to the router (None: read from the model's files where `model` names files on
    this host, else left to the worker)."""
    if config.redis_url is None:
        raise ValueError("the ingress needs a Redis URL: give --redis-url or set REDIS_URL")
    frontend_id = frontend_id or unique_consumer_name("ingress")
    tenants = tenants or Tenants()
    shards = Shards.connect(config, lambda url: async_redis(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S
    ))  # fmt: skip
    client = shards.own.redis
    state = IngressState(
        config=config,
        model=model,
        frontend_id=frontend_id,
        max_queue=max_queue,
        redis=client,
        replies=AsyncReplyReader(client, config.reply_stream(frontend_id)),
        health=WorkerHealth(client, config),
        queue=QueueDepth(client, config),
        openapi=openapi_document(model),
        metrics=IngressMetrics(frontend_id, config.metrics),
        tenants=tenants,
        tenant_limits=TenantLimits(shards.home.redis, shards.home.config),
        shards=shards,
        limits=ModelLimits(context_length=context_length or context_length_if_known(model)),
    )
    middlewares = [metrics_middleware, error_middleware, body_deadline]  # the 408 inside
    if api_keys:
        middlewares.append(auth_middleware(api_keys))  # inside error_middleware: 401 body
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[KEYS_CHECKED] = bool(api_keys)
    app[STATE] = state
    app[BODY_TIMEOUT_S] = config.ingress_body_timeout_s
    app.cleanup_ctx.append(_bus_lifetime)
    app.on_shutdown.append(_drain)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", service_endpoints.models)
    app.router.add_get("/v1/models/{model}", service_endpoints.model)
    app.router.add_post("/generate", handlers.generate)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/abort/{id}", service_endpoints.abort)
    app.router.add_get("/health", service_endpoints.health)
    app.router.add_get("/metrics", service_endpoints.metrics)
    app.router.add_get("/openapi.json", service_endpoints.openapi)
    app.router.add_get("/status", status_page)
    app.router.add_get("/status.json", status_json)
    batch_api.add_routes(app)
    responses_api.add_routes(app)
    admin_weights.add_routes(app, tuple(admin_keys))
    return app


async def _bus_lifetime(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.replies.start()
    # A blocking client for threads: the metrics' publisher and /metrics' collector, and
    # the file and batch stores' calls on the executor.
    state.sync_redis = _sync_client(state.config)
    state.other_sync_redis = {s.config.shard: _sync_client(s.config) for s in state.shards.others}
    publisher = start_publisher(state.sync_redis, state.config, state.metrics.process)
    state.metrics_publisher = publisher
    alive = asyncio.get_running_loop().create_task(
        announce_alive(state.redis, state.config, state.frontend_id)
    )
    runner = asyncio.get_running_loop().create_task(BatchRunner(state).run())
    renewals = asyncio.get_running_loop().create_task(_renew_tenant_slots(state))
    charges = asyncio.get_running_loop().create_task(_flush_tenant_tokens(state))
    key_renewals = asyncio.get_running_loop().create_task(_renew_keys(state))
    logger.info("ingress %s: replies on %s", state.frontend_id, state.reply_stream)
    yield
    alive.cancel()
    renewals.cancel()
    charges.cancel()
    key_renewals.cancel()
    # Its lines' submissions abort their requests as they unwind; its leases are let go
    # so another replica takes its batches at once.
    await cancel_and_wait([runner])
    # Handlers cancelled at shutdown have queued their aborts: let them reach Redis.
    for writes in state.request_writes.values():
        await writes.drain(CONNECT_TIMEOUT_S)
    if state.background:
        await asyncio.wait(list(state.background), timeout=CONNECT_TIMEOUT_S)
    for task in list(state.settling):
        task.cancel()  # what dropped requests used past here goes uncharged
    try:
        await state.tenant_limits.flush()
    except (redis.ConnectionError, redis.TimeoutError):
        pass  # the tokens of this replica's last second go uncharged
    # Streams handed over still need this stream's history; the gone liveness key lets
    # their clients resume them at once.
    await state.replies.close(delete_stream=not state.handed_over)
    try:
        await state.redis.delete(state.config.frontend_key(state.frontend_id))
    except REDIS_TRANSIENT:
        pass  # it expires within seconds anyway
    if state.handed_over:
        logger.info("ingress %s: %d streams left running for their clients to resume",
                    state.frontend_id, state.handed_over)  # fmt: skip
    if publisher is not None:
        await asyncio.get_running_loop().run_in_executor(None, publisher.close)
    for client in (state.sync_redis, *state.other_sync_redis.values()):
        client.close()
    await state.redis.aclose()
    await state.shards.aclose()


def _sync_client(config: BusConfig) -> redis.Redis:
    return redis.Redis.from_url(config.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                socket_timeout=SOCKET_TIMEOUT_S)  # fmt: skip


async def _renew_tenant_slots(state: IngressState) -> None:
    """Keep the running slots of this replica's requests (their leases end otherwise)."""
    while True:
        await asyncio.sleep(LEASE_S / 3)
        try:
            await state.tenant_limits.renew(dict(state.running_tenants))
        except REDIS_TRANSIENT as exc:
            logger.warning("could not renew the tenants' running slots: %s", exc)


async def _flush_tenant_tokens(state: IngressState) -> None:
    """Send the tokens charged to tenants, once per CHARGE_INTERVAL_S."""
    while True:
        await asyncio.sleep(CHARGE_INTERVAL_S)
        try:
            await state.tenant_limits.flush()
        except REDIS_TRANSIENT as exc:
            logger.warning("could not charge the tenants' tokens: %s", exc)


async def _renew_keys(state: IngressState) -> None:
    """Keep this replica's reply stream and its running requests' keys past their TTL."""
    while True:
        await asyncio.sleep(state.config.reply_ttl_s / RENEWALS_PER_TTL)
        try:
            await state.renew_keys()
        except redis.RedisError as exc:  # the next pass tries again, well within the TTL
            logger.warning("could not renew the running requests' keys: %s", exc)


async def _drain(app: web.Application) -> None:
    """SIGTERM, before in-flight handlers get their last seconds: from now on a stream cut
    by the shutdown is handed over (left running, its history kept), not aborted."""
    state = app[STATE]
    state.draining = True
    state.replies.trim = False


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[STATE].metrics
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    metrics.in_flight.inc()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        metrics.in_flight.dec()
        metrics.requests.labels(endpoint, str(status)).inc()


async def serve(
    app: web.Application,
    *,
    host: str,
    port: int,
    stop: asyncio.Event,
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
) -> None:
    """Serve `app` until `stop` is set, then drain and clean up."""
    config = app[STATE].config
    BadRequestLog.install()
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout_s,
                           keepalive_timeout=config.ingress_header_timeout_s)  # fmt: skip
    await runner.setup()
    try:
        await CappedSite(runner, host, port, config.ingress_max_connections).start()
        for address in runner.addresses:
            logger.info("ingress listening on http://%s:%d", *address[:2])
        await stop.wait()
        logger.info("ingress stopping")
    finally:
        await runner.cleanup()


def run(
    config: BusConfig,
    *,
    host: str,
    port: int,
    model: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int = DEFAULT_MAX_QUEUE,
) -> None:
    """Serve until SIGTERM or SIGINT; `config` attached to its shard on a Redis Cluster
    (runtime/cluster.py), as `streamserve stage ingress` does."""
    app = create_app(config, model=model, max_body_bytes=max_body_bytes, max_queue=max_queue,
                     api_keys=api_keys_from_env(), tenants=tenants_from_env(),
                     admin_keys=admin_weights.admin_keys_from_env())  # fmt: skip

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await serve(app, host=host, port=port, stop=stop)

    settle_heap()
    event_loop.run(main())
