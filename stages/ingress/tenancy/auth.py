"""Optional API keys: with ``STREAMSERVE_API_KEY`` set (several keys separated by commas),
every generation, model and abort endpoint wants ``Authorization: Bearer <key>`` and answers
401 without one, as OpenAI does. ``/health``, ``/metrics`` and ``/openapi.json`` stay open
for load balancers and scrapers, and ``/status`` with its ``/status.json`` for operators'
browsers, which send no key. ``/admin/*`` takes the admin key instead
(stages/ingress/api/admin_weights.py). Keys come from the environment, not the command
line, where ``ps`` would show them.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping, Sequence

from aiohttp import web

from stages.ingress.errors import ApiError, Handler

API_KEY_ENV = "STREAMSERVE_API_KEY"
# Whether the app checks keys: then each key owns its data (stages/ingress/tenancy/ownership.py).
KEYS_CHECKED = web.AppKey("streamserve_keys_checked", bool)
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/status", "/status.json"})
ADMIN_PREFIX = "/admin/"  # checked against the admin key, not the API keys


def api_keys_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    return tuple(key.strip() for key in environ.get(API_KEY_ENV, "").split(",") if key.strip())


def auth_middleware(keys: Sequence[str]):
    expected = [key.encode() for key in keys]

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS and not request.path.startswith(ADMIN_PREFIX):
            if not presents_key(request, expected):
                raise ApiError(
                    401,
                    "a valid API key is required: send Authorization: Bearer <key>",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return check_key


def presents_key(request: web.Request, expected: Sequence[bytes]) -> bool:
    """Whether the request's ``Authorization: Bearer`` names one of the `expected` keys."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # Compare with every key in constant time: no timing tells how much matched. A header's
    # bytes that are not UTF-8 come as surrogates (aiohttp's surrogateescape): their bytes
    # again, a key no one configured, not an error.
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    matches = [hmac.compare_digest(given_bytes, key) for key in expected]
    return scheme.lower() == "bearer" and any(matches)


def bearer_key(request: web.Request) -> str | None:
    """The API key the request sends (checked by `auth_middleware` when keys are set): it
    names the request's tenant (stages/ingress/tenancy/tenants.py)."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" and given.strip() else None
