"""Every failure is an OpenAI-style error body: ``{"error": {message, type, param, code}}``.

Handlers raise `ApiError`, jobs/errors.py's `RequestError` with response headers; the
middleware also turns aiohttp's own HTTP exceptions (unknown path, wrong method, body over
``client_max_size``), an unreachable Redis (503) and a full one (503 with Retry-After: it
runs with ``maxmemory`` and ``noeviction``, so it refuses writes rather than evict) into that
body, and anything else into a logged 500, so a client never sees an HTML page or a dropped
connection. What a handler raises once its client has left is no failure: it ends as a
handler cancelled for its client's leaving does, unlogged and counted 499.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import redis
from aiohttp import web

from jobs.errors import RequestError
from jobs.protocol import ErrorReply

logger = logging.getLogger(__name__)

# Memory comes back as streams are trimmed and jobs finish: seconds, not minutes.
REDIS_FULL_RETRY_AFTER_S = 5

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Refusal = TypeVar("Refusal", "ApiError", ErrorReply)  # what carries a param and a message


class ApiError(RequestError):
    """A RequestError as the HTTP API answers it: with response headers, as an error body."""

    def __init__(self, *args: Any, headers: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.headers = dict(headers or {})

    @classmethod
    def of(cls, error: RequestError) -> ApiError:
        """`error` as the HTTP API answers it (a store's refusal, raised on the bus side)."""
        if isinstance(error, ApiError):
            return error
        return cls(error.status, error.message, error.type, error.param, error.code)

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(error_body(self)),
            content_type="application/json",
            headers=self.headers,
        )


def error_body(error: RequestError | ErrorReply) -> dict[str, Any]:
    """The OpenAI error body: ``{"error": {message, type, param, code}}``."""
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }


def in_request_words(error: Refusal, names: Mapping[str, str]) -> Refusal:
    """`error` naming its field as the request does (a job's max_new_tokens is a chat's
    max_tokens, its json_schema the request's response_format), its message too."""
    field = error.param
    param = names.get(field) if field else None
    if param is not None:  # so field is set
        if error.message.startswith(field):
            error.message = param + error.message[len(field) :]
        error.param = param
    return error


def redis_unavailable(exc: Exception) -> ApiError:
    return ApiError(
        503,
        f"the request bus (Redis) is unreachable: {exc}",
        "service_unavailable",
        None,
        "redis_unavailable",
    )


def redis_full(exc: Exception) -> ApiError:
    """Redis is at its maxmemory: nothing new is accepted until memory is freed."""
    return ApiError(
        503,
        f"the request bus (Redis) is full and accepts no new work for now; retry later ({exc})",
        "service_unavailable",
        None,
        "redis_full",
        headers={"Retry-After": str(REDIS_FULL_RETRY_AFTER_S)},
    )


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no such path: {request.path}", code="not_found")
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return ApiError(
            405,
            f"method {request.method} is not allowed on {request.path}"
            + (f" (allowed: {allowed})" if allowed else ""),
            code="method_not_allowed",
            headers={"Allow": allowed} if allowed else None,
        )
    if exc.status == 413:
        return ApiError(
            413,
            f"the request body is too large: {exc.text or exc.reason}",
            code="request_too_large",
        )
    return ApiError(exc.status, exc.text or exc.reason, code=None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:  # ApiError, or bus/'s own (e.g. a batch store's 404)
        return ApiError.of(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(request, exc).response()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        logger.warning("%s %s: Redis unreachable: %s", request.method, request.path, exc)
        return redis_unavailable(exc).response()
    except redis.OutOfMemoryError as exc:
        logger.warning("%s %s: Redis full: %s", request.method, request.path, exc)
        return redis_full(exc).response()
    except web.RequestPayloadError as exc:  # a body aiohttp cannot read: a bad gzip, a bad chunk
        if client_gone(request):
            raise asyncio.CancelledError from exc  # a body cut by its client's leaving
        cause = exc.__cause__  # aiohttp's own error, whose text is the fault alone
        fault = " ".join(str(getattr(cause, "message", None) or exc).split())
        response = ApiError(400, f"the request body cannot be read: {fault}",
                            code="invalid_body").response()  # fmt: skip
        response.force_close()  # aiohttp drops the connection after it: say so to the client
        return response
    except Exception as exc:
        if client_gone(request):
            # Met as its client left (a send to the closed connection, a handler whose
            # cancellation a library lost: runtime/task_cancel.py): no failure of ours, and
            # no one to answer. Ended as aiohttp ends a handler whose client left (499).
            logger.debug("%s %s: its client left: %r", request.method, request.path, exc)
            raise asyncio.CancelledError from exc
        logger.exception("%s %s failed", request.method, request.path)
        return ApiError(500, "internal error", "internal_error", None, "internal_error").response()


def client_gone(request: web.Request) -> bool:
    """Whether the request's connection is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()
