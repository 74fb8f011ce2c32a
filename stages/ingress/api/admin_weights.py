"""``/admin/weights``: new weights for every worker, and how far the fleet has got.

    POST /admin/weights  {"model": "<path or model name the workers resolve>"}   -> 202
    GET  /admin/weights                                                          -> 200

Both want ``Authorization: Bearer <admin key>``, the key set in ``STREAMSERVE_ADMIN_KEY``
(several separated by commas). API keys (``STREAMSERVE_API_KEY``) do not open them: a
tenant that may generate may not change what every tenant is served. With no admin key
configured the endpoints answer 404, as if they did not exist (no key can be guessed); with a
wrong or missing key, 401. Every answer is JSON, errors in OpenAI's shape.

POST writes the fleet's weights record (jobs/weights.py) and answers at once with the version
it made: each worker notices it within a heartbeat, drains, loads, checks and swaps
(gpu_worker/weights_update.py). GET shows the version asked for and each live worker's
version, the version it is moving to, and why its last load failed; ``converged`` once every
live worker serves the version asked for or has failed to load it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from aiohttp import web

from bus.weights_admin import read_fleet_async, set_weights_async
from jobs.field_error import FieldError
from jobs.weights import check_source
from stages.ingress.body import read_object
from stages.ingress.errors import ApiError
from stages.ingress.state import STATE
from stages.ingress.tenancy.auth import presents_key

ADMIN_KEY_ENV = "STREAMSERVE_ADMIN_KEY"
ADMIN_KEYS = web.AppKey("streamserve_admin_keys", tuple)


def admin_keys_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    return tuple(key.strip() for key in environ.get(ADMIN_KEY_ENV, "").split(",") if key.strip())


def add_routes(app: web.Application, admin_keys: tuple[str, ...]) -> None:
    app[ADMIN_KEYS] = admin_keys
    app.router.add_post("/admin/weights", update_weights)
    app.router.add_get("/admin/weights", weights_status)


async def update_weights(request: web.Request) -> web.Response:
    _check_admin(request)
    try:
        source = check_source(await read_object(request))
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.field, code="invalid_weights_source") from None
    state = request.app[STATE]
    shards = [(shard.redis, shard.config) for shard in state.shards.all]
    record = await set_weights_async(shards, source)
    body = await read_fleet_async(shards)
    return web.json_response({**body, "desired": record.to_json()}, status=202)


async def weights_status(request: web.Request) -> web.Response:
    _check_admin(request)
    shards = [(shard.redis, shard.config) for shard in request.app[STATE].shards.all]
    return web.json_response(await read_fleet_async(shards))


def _check_admin(request: web.Request) -> None:
    keys = request.app[ADMIN_KEYS]
    if not keys:
        raise ApiError(
            404,
            f"the admin API is off: set {ADMIN_KEY_ENV} on the ingress to turn it on",
            code="admin_api_disabled",
        )
    if not presents_key(request, [key.encode() for key in keys]):
        raise ApiError(
            401,
            "a valid admin key is required: send Authorization: Bearer <admin key>",
            code="invalid_admin_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def openapi_path(errors: dict[str, object]) -> dict[str, object]:
    """``/admin/weights`` in /openapi.json; `errors`: the error answers, described there."""
    body = {"type": "object", "required": ["model"], "additionalProperties": False,
            "properties": {"model": {"type": "string", "minLength": 1}}}  # fmt: skip
    answer = {"application/json": {"schema": {"type": "object"}}}
    return {
        "post": {
            "summary": "Serve other weights on every worker (needs the admin key)",
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"202": {"description": "asked for: each worker updates within a "
                                  "heartbeat", "content": answer}, **errors},
        },
        "get": {
            "summary": "The weights asked for and each worker's (needs the admin key)",
            "responses": {"200": {"description": "OK", "content": answer}, **errors},
        },
    }  # fmt: skip
