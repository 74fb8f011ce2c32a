"""OpenAI's `/v1/files` and `/v1/batches`, over the stores in batch_store/ (Redis is their only
state, so any replica answers for any file or batch; runner.py runs the
batches). Each request sees only its owner's files and batches (tenancy/ownership.py):
another owner's are a 404. The stores are blocking: their calls run on the executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from batch_store.batches import BatchStore
from batch_store.files import FileStore
from jobs.unicode_text import NotUnicode, check_string
from stages.ingress.body import OBJECT, STR, field, read_object, reject_unknown
from stages.ingress.errors import ApiError
from stages.ingress.state import STATE
from stages.ingress.tenancy.auth import bearer_key
from stages.ingress.tenancy.ownership import owner_of

T = TypeVar("T")
UPLOAD_CHUNK = 2**20
BATCH_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata",
                "output_expires_after")  # fmt: skip
EXPIRES_AFTER_PARTS = {"expires_after[anchor]": "anchor", "expires_after[seconds]": "seconds"}


def _stores(request: web.Request) -> tuple[FileStore, BatchStore]:
    """The stores as the request's owner sees them."""
    state = request.app[STATE]
    assert state.home_sync_redis is not None  # files and batches live on the home shard
    owner = owner_of(request, state.tenants)
    client, config = state.home_sync_redis, state.shards.home.config
    files = FileStore(client, config, owner)
    return files, BatchStore(client, config, files, owner)


async def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer; got {raw!r}", param=name,
                       code="invalid_value") from None  # fmt: skip


# ---- files -------------------------------------------------------------------------------


async def create_file(request: web.Request) -> web.Response:
    """multipart/form-data with `purpose` and `file` (and OpenAI's ``expires_after[anchor]``
    and ``expires_after[seconds]``), as the OpenAI clients send it."""
    files, _ = _stores(request)
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "upload a file as multipart/form-data with fields file and purpose",
                       param="file", code="invalid_content_type")  # fmt: skip
    try:
        purpose, filename, content, expires_after = await _read_form(request, files.max_bytes)
    except (HttpProcessingError, ValueError, LookupError, AssertionError) as exc:
        raise ApiError(400, f"the multipart body is malformed: {exc}", param="file",
                       code="invalid_multipart") from None  # fmt: skip
    if content is None:
        raise ApiError(400, "the form has no file field", param="file", code="missing_field")
    if purpose is None:
        raise ApiError(400, "the form has no purpose field", param="purpose",
                       code="missing_field")  # fmt: skip
    created = await _call(files.create, content, filename, purpose, expires_after)
    return web.json_response(created)


async def _read_form(request: web.Request, max_bytes: int) -> tuple[Any, Any, Any, Any]:
    """(purpose, filename, content, expires_after) of an upload form, each None if it is
    missing."""
    purpose, filename, content, expires_after = None, None, None, {}
    seen: set[str] = set()
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue
        if part.name in seen:  # which one would count is anyone's guess: neither
            raise ApiError(400, f"the form field {part.name!r} is given more than once",
                           param=part.name)  # fmt: skip
        if part.name is not None:
            seen.add(part.name)
        if part.name == "purpose":
            purpose = (await part.text()).strip()
        elif part.name == "file":
            filename = _filename(part.filename)
            content = await _read_limited(part, max_bytes)
        elif part.name in EXPIRES_AFTER_PARTS:
            name = EXPIRES_AFTER_PARTS[part.name]
            expires_after[name] = await _expires_part(part, name)
    return purpose, filename, content, expires_after or None


def _filename(given: str | None) -> str:
    """The upload's file name: bytes that are not UTF-8 (aiohttp hands them on as
    surrogates) are refused, not stored as a name no reply could encode."""
    if not given:
        return "upload.jsonl"
    try:
        check_string(given, "file")
    except NotUnicode:
        raise ApiError(400, "the file's name is not valid UTF-8", param="file",
                       code="invalid_value") from None  # fmt: skip
    return given


async def _expires_part(part: BodyPartReader, name: str) -> Any:
    """A form's ``expires_after[...]`` value: the seconds as an integer when they are one
    (the store's check says what is wrong otherwise)."""
    text = (await part.text()).strip()
    if name == "seconds" and text.lstrip("-").isdigit():
        return int(text)
    return text


async def _read_limited(part: BodyPartReader, limit: int) -> bytes:
    """The part's bytes, refused with a 413 past `limit` without reading it all."""
    chunks, size = [], 0
    while chunk := await part.read_chunk(UPLOAD_CHUNK):
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the file is over the limit of {limit} bytes", param="file",
                           code="file_too_large")  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


async def list_files(request: web.Request) -> web.Response:
    files, _ = _stores(request)
    listing = await _call(files.list, purpose=request.query.get("purpose"),
                          after=request.query.get("after"),
                          limit=_int_query(request, "limit", 10_000),
                          order=request.query.get("order", "desc"))  # fmt: skip
    return web.json_response(listing)


def _by_id(
    key: str, method: Callable[[FileStore, BatchStore], Callable[[str], Any]]
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A route answering with the JSON of one store call on the object its path names
    (`key`): `method` picks the call from the request's stores."""

    async def handle(request: web.Request) -> web.Response:
        return web.json_response(await _call(method(*_stores(request)), request.match_info[key]))

    return handle


retrieve_file = _by_id("file_id", lambda files, batches: files.get)
delete_file = _by_id("file_id", lambda files, batches: files.delete)


async def file_content(request: web.Request) -> web.Response:
    files, _ = _stores(request)
    content = await _call(files.content, request.match_info["file_id"])
    return web.Response(body=content, content_type="application/octet-stream")


# ---- batches -----------------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    _, batches = _stores(request)
    data = await read_object(request)
    reject_unknown(data, BATCH_FIELDS)
    input_file_id = field(data, "input_file_id", STR)
    endpoint = field(data, "endpoint", STR)
    for name, value in (("input_file_id", input_file_id), ("endpoint", endpoint)):
        if value is None:
            raise ApiError(400, f"{name} is required", param=name, code="missing_field")
    window = field(data, "completion_window", STR) or "24h"
    metadata = field(data, "metadata", OBJECT)
    output_expires_after = field(data, "output_expires_after", OBJECT)
    tenant = request.app[STATE].tenants.for_key(bearer_key(request)).id
    batch = await _call(batches.create, input_file_id, endpoint, window, metadata, tenant,
                        output_expires_after)  # fmt: skip
    return web.json_response(batch)


async def list_batches(request: web.Request) -> web.Response:
    _, batches = _stores(request)
    listing = await _call(batches.list, after=request.query.get("after"),
                          limit=_int_query(request, "limit", 20))  # fmt: skip
    return web.json_response(listing)


retrieve_batch = _by_id("batch_id", lambda files, batches: batches.get)
cancel_batch = _by_id("batch_id", lambda files, batches: batches.cancel)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/files", create_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
