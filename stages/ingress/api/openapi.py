"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``.

The request schemas (openapi_schemas.py) are built from the tables the parsers check bodies
against, so a field the server accepts is a field the description names, with the same
JSON types; `tests/test_openapi.py` holds the two together and checks every route is
described.
"""

from __future__ import annotations

from typing import Any

from batch_store.files import EXPIRES_AFTER_S
from batch_store.metadata import METADATA_SCHEMA
from stages.ingress.api import admin_weights, embeddings
from stages.ingress.api.openapi_schemas import (
    chat_request,
    completion_request,
    generate_request,
)
from stages.ingress.responses import request as responses_request

SSE = (
    "each event `data: <chunk JSON>`; the last one `data: [DONE]`. A stream whose client "
    "asked to resume it (X-Resumable-Stream: true, stream_options.resumable, Last-Event-ID, "
    "or Accept: text/event-stream) has an `id: <event id>` line before each chunk's data"
)


ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _ref(schema: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{schema}"}


def _errors(*statuses: int) -> dict[str, Any]:
    meaning = {
        400: "a bad value, an unknown field, a prompt beyond the context",
        401: "a missing or wrong API key",
        403: "a priority below the lowest the API key may ask for (its min_priority)",
        408: "a body slower than the ingress's body deadline",
        404: "an unknown model, path, request, file or batch",
        409: "a resume of a stream its ingress still serves",
        413: "a body over the limit",
        422: "JSON of the wrong shape or type",
        429: "too many jobs waiting, the API key past its limits (see Retry-After), or its owner's "
        "active batches at their bound",
        503: "Redis unreachable, no live worker, or too many connections open",
    }
    error = {"application/json": {"schema": _ref("Error")}}
    return {str(status): {"description": meaning[status], "content": error} for status in statuses}


def _generation(summary: str, schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "resume a stream whose ingress died: the same body, and "
                    "the id of the last event received",
                },
                {
                    "name": "X-Resumable-Stream",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                    "description": "true: each streamed event carries an `id:` line to resume "
                    "from; false: none (another value counts as unset). Unset, ids go only to "
                    "clients that accept text/event-stream (EventSource): OpenAI's streams "
                    "carry none",
                },
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(schema)}},
            },
            "responses": {
                "200": {
                    "description": "the whole answer as JSON, or with stream: true SSE chunks "
                    "ending with `data: [DONE]`",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"description": SSE}},
                    },
                },  # fmt: skip
                **_errors(400, 401, 403, 404, 408, 409, 413, 422, 429, 503),
            },
        }
    }


def _get(summary: str, content_type: str = "application/json", *errors: int) -> dict[str, Any]:
    schema = {"type": "string"} if content_type.startswith("text/") else {"type": "object"}
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": {content_type: {"schema": schema}}},
                **_errors(*errors),
            },
        }
    }


def _operation(method: str, summary: str, errors: tuple[int, ...], path_param: str | None = None,
               body: dict[str, Any] | None = None, query: tuple[str, ...] = (),
               content_type: str = "application/json") -> dict[str, Any]:  # fmt: skip
    """One operation of the files and batches API (OpenAI's objects, not described here)."""
    parameters = [{"name": path_param, "in": "path", "required": True,
                   "schema": {"type": "string"}}] if path_param else []  # fmt: skip
    parameters += [{"name": name, "in": "query", "required": False,
                    "schema": {"type": "integer" if name == "limit" else "string"}}
                   for name in query]  # fmt: skip
    schema = {"type": "string"} if content_type != "application/json" else {"type": "object"}
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": {content_type: {"schema": schema}}},
                      **_errors(*errors)},
    }  # fmt: skip
    if parameters:
        operation["parameters"] = parameters
    if body is not None:
        operation["requestBody"] = {"required": True, "content": body}
    return {method: operation}


def _batch_paths() -> dict[str, Any]:
    least, most = EXPIRES_AFTER_S
    seconds = {"type": "integer", "minimum": least, "maximum": most}
    expires_after = {"type": "object", "required": ["anchor", "seconds"], "properties": {
        "anchor": {"type": "string", "enum": ["created_at"]}, "seconds": seconds}}  # fmt: skip
    upload = {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"},
                       "purpose": {"type": "string", "enum": ["batch"]},
                       "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                       "expires_after[seconds]": seconds}}}}  # fmt: skip
    create = {"application/json": {"schema": {
        "type": "object", "required": ["input_file_id", "endpoint"],
        "properties": {"input_file_id": {"type": "string"},
                       "endpoint": {"type": "string",
                                    "enum": ["/v1/chat/completions", "/v1/completions"]},
                       "completion_window": {"type": "string", "enum": ["24h"]},
                       "metadata": METADATA_SCHEMA,
                       "output_expires_after": expires_after}}}}  # fmt: skip
    return {
        "/v1/files": {
            **_operation(
                "post", "Upload a JSONL file (purpose batch)", (400, 401, 413), body=upload
            ),
            **_operation(
                "get",
                "List files, newest first",
                (400, 401),
                query=("purpose", "after", "limit", "order"),
            ),
        },  # fmt: skip
        "/v1/files/{file_id}": {
            **_operation("get", "A file's object", (401, 404), "file_id"),
            **_operation("delete", "Delete a file", (401, 404), "file_id"),
        },
        "/v1/files/{file_id}/content": _operation(
            "get", "A file's bytes", (401, 404), "file_id", content_type="application/octet-stream"
        ),
        "/v1/batches": {
            **_operation(
                "post",
                "Create a batch from an uploaded file",
                (400, 401, 404, 422, 429),
                body=create,
            ),
            **_operation("get", "List batches, newest first", (400, 401), query=("after", "limit")),
        },  # fmt: skip
        "/v1/batches/{batch_id}": _operation("get", "A batch's object", (401, 404), "batch_id"),
        "/v1/batches/{batch_id}/cancel": _operation(
            "post",
            "Cancel a batch: its running lines stop, what finished is kept",
            (400, 401, 404),
            "batch_id",
        ),  # fmt: skip
    }


def _responses_paths() -> dict[str, Any]:
    """OpenAI's Responses API (stages/ingress/responses/)."""
    create = _generation("Create a response: whole, streamed (SSE `event:`/`data:` pairs), or "
                         "in the background", "ResponseCreateRequest")  # fmt: skip
    del create["post"]["parameters"]  # resumed by GET, not Last-Event-ID
    create["post"]["responses"]["200"]["description"] = "a Response object, or its stream events"
    one = ("response_id",)
    get = _operation("get", "A stored response; with stream=true its stream resumed after "
                     "starting_after (its replica died)", (400, 401, 404, 409), *one)  # fmt: skip
    get["get"]["parameters"] += [{"name": name, "in": "query", "required": False,
                                  "schema": {"type": kind}}
                                 for name, kind in (("stream", "boolean"),
                                                    ("starting_after", "integer"))]  # fmt: skip
    return {
        "/v1/responses": create,
        "/v1/responses/{response_id}": {
            **get, **_operation("delete", "Delete a stored response", (401, 404), *one)},
        "/v1/responses/{response_id}/input_items": _operation(
            "get", "A response's input items", (400, 401, 404), *one,
            query=("after", "limit", "order")),
        "/v1/responses/{response_id}/cancel": _operation(
            "post", "Cancel a background response", (400, 401, 404), *one),
    }  # fmt: skip


def openapi_document(model: str) -> dict[str, Any]:
    abort = {
        "post": {
            "summary": "Stop a running request by its response id (or native meta_info.id)",
            "parameters": [
                {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {
                "200": {
                    "description": "aborted: its stream ends with finish_reason abort",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                **_errors(401, 404, 503),
            },  # fmt: skip
        }
    }
    model_path = _get("The served model", "application/json", 401, 404)
    model_path["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "streamserve",
            "version": "1",
            "description": f"OpenAI-compatible API serving `{model}`.",
        },
        "paths": {
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
            "/v1/completions": _generation("Text completion", "CompletionRequest"),
            "/generate": _generation("Native generation (text or token ids)", "GenerateRequest"),
            "/v1/embeddings": embeddings.openapi_path(
                _errors(400, 401, 403, 404, 408, 413, 422, 429, 503)
            ),
            "/v1/abort/{id}": abort,
            "/v1/models": _get("The served model, as a list", "application/json", 401),
            "/v1/models/{model}": model_path,
            "/health": _get(
                "200 when Redis answers and a worker is alive: the live workers' count, and "
                "what serves attention on each (`serving`)",
                "application/json",
                503,
            ),  # fmt: skip
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("This description"),
            "/status": _get("A live page of the pipeline, drawn from /status.json", "text/html"),
            "/status.json": _get(
                "The deployment's stages, streams, workers and throughput, as "
                "`streamserve status --once --json` prints them",
                "application/json",
                503,
            ),  # fmt: skip
            **_batch_paths(),
            **_responses_paths(),
            "/admin/weights": admin_weights.openapi_path(_errors(400, 401, 404, 413, 422, 503)),
        },
        "components": {
            "schemas": {
                "ChatCompletionRequest": chat_request(),
                "CompletionRequest": completion_request(),
                "GenerateRequest": generate_request(),
                "ResponseCreateRequest": responses_request.openapi_schema(),
                "EmbeddingRequest": embeddings.openapi_request(),
                "Error": ERROR,
            }
        },
    }
