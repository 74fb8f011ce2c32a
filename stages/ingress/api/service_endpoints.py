"""The endpoints that generate nothing: the model list, aborts, the OpenAPI document,
health and metrics (the generation endpoints are handlers.py's)."""

from __future__ import annotations

import asyncio

import redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from bus.aborts import publish_aborts_async
from observability.deployment_metrics import deployment_registry, render
from stages.ingress.api.params import check_model
from stages.ingress.errors import ApiError
from stages.ingress.health import serving_paths
from stages.ingress.state import STATE
from stages.ingress.tenancy.ownership import owner_of

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [state.model_card()]})


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_model({"model": request.match_info["model"]}, state.model)
    return web.json_response(state.model_card())


async def abort(request: web.Request) -> web.Response:
    """Stop a request some ingress replica is serving (its response ``id``, or a native
    ``meta_info.id``): its workers free its KV within about ``abort_check_interval_ms``
    (they read the aborts stream, bus/aborts.py), and its stream ends with finish_reason
    "abort". Another owner's request is as unknown as a finished one."""
    state = request.app[STATE]
    request_id = request.match_info["id"]
    found = await state.sub_requests(request_id, owner_of(request, state.tenants))
    if found is None:
        raise ApiError(
            404, f"no request {request_id!r} is running", param="id", code="request_not_found"
        )
    shard, rids = found
    await publish_aborts_async(shard.redis, shard.config, rids)
    state.metrics.aborts.inc(len(rids))
    return web.json_response({"id": request_id, "object": "abort", "aborted": len(rids)})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].openapi)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await state.redis.ping()  # an unreachable Redis is a 503 from the middleware
    liveness = await state.health.liveness(fresh=True)
    if not liveness.alive:
        raise ApiError(
            503,
            "no live worker (no worker heartbeat in Redis)",
            "service_unavailable",
            None,
            "no_worker",
        )
    return web.json_response(
        {"status": "ok", "workers": len(liveness.alive), "serving": serving_paths(liveness)}
    )


async def metrics(request: web.Request) -> web.Response:
    """The whole deployment's metrics (observability/deployment_metrics.py); this replica's alone
    while Redis cannot be read."""
    state = request.app[STATE]
    if state.deployment_metrics is None:
        state.deployment_metrics = deployment_registry(state.sync_shards,
                                                       state.metrics_publisher)  # fmt: skip
    loop = asyncio.get_running_loop()
    try:  # the collector's Redis calls are blocking: off the event loop
        body = await loop.run_in_executor(None, render, state.deployment_metrics)
    except redis.RedisError:
        body = await loop.run_in_executor(None, render, state.metrics.process.registry)
    return web.Response(body=body, headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})
