"""OpenAI's files, kept in Redis: what `/v1/files` serves and what batches read and write.

A file is one hash, ``<p>:file:<id>`` with its object (JSON) and its bytes, and an entry in
the sorted set ``<p>:files`` (by creation time) that lists them. Redis is the only shared
state (docs/ARCHITECTURE.md): any ingress replica serves any file, and with append-only
persistence a file outlives a restart of Redis itself.

Users upload files with purpose ``batch``; a batch writes its output and error files with
purposes ``batch_output`` and ``batch_error``. Blocking calls on a redis-py client: the
ingress runs them on its executor.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from bus.config import BusConfig
from bus.errors import RequestError

UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSES = ("batch_output", "batch_error")
MAX_LIST_LIMIT = 10_000
LIST_CHUNK = 100  # objects read per round trip while listing


def not_found(what: str, ident: str, param: str | None = None) -> RequestError:
    return RequestError(404, f"no {what} with id {ident!r}", "invalid_request_error", param,
                        "not_found")  # fmt: skip


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list of objects, with the ids a client pages by."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def check_limit(limit: int, most: int = MAX_LIST_LIMIT) -> None:
    if not 1 <= limit <= most:
        raise RequestError(400, f"limit must be between 1 and {most}; got {limit}",
                           param="limit")  # fmt: skip


class FileStore:
    def __init__(self, client: redis.Redis, config: BusConfig) -> None:
        self.client = client
        self.config = config
        self.max_bytes = config.max_file_bytes
        self.index = f"{config.stream_prefix}:files"

    def key(self, file_id: str) -> str:
        return f"{self.config.stream_prefix}:file:{file_id}"

    def create(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """A user's upload: checked, stored, its file object returned."""
        if purpose not in UPLOAD_PURPOSES:
            raise RequestError(400, f"purpose must be one of {list(UPLOAD_PURPOSES)}; got "
                               f"{purpose!r}", param="purpose")  # fmt: skip
        if len(content) > self.max_bytes:
            message = f"the file has {len(content)} bytes, over the limit of {self.max_bytes}"
            raise RequestError(413, message, param="file", code="file_too_large")
        if not content:
            raise RequestError(400, "the file is empty", param="file")
        return self.put("file-" + uuid.uuid4().hex[:24], content, filename, purpose)

    def put(self, file_id: str, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """Store `content` under `file_id`, replacing what was there: a batch's output file
        has an id of its own derived from the batch, so writing it again (a runner that
        died while finalizing) leaves one file."""
        created = int(time.time())
        obj = {
            "id": file_id, "object": "file", "bytes": len(content), "created_at": created,
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": None, "status_details": None,
        }  # fmt: skip
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key(file_id), mapping={"object": json.dumps(obj), "content": content})
        pipe.zadd(self.index, {file_id: time.time()})  # finer than created_at: the list order
        pipe.execute()
        return obj

    def get(self, file_id: str) -> dict[str, Any]:
        raw = self.client.hget(self.key(file_id), "object")
        if raw is None:
            raise not_found("file", file_id, "file_id")
        return json.loads(raw)

    def content(self, file_id: str) -> bytes:
        content = self.client.hget(self.key(file_id), "content")
        if content is None:
            raise not_found("file", file_id, "file_id")
        return content

    def delete(self, file_id: str) -> dict[str, Any]:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.key(file_id))
        pipe.zrem(self.index, file_id)
        deleted, _ = pipe.execute()
        if not deleted:
            raise not_found("file", file_id, "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    def list(self, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             order: str = "desc") -> dict[str, Any]:  # fmt: skip
        """Files newest first (``order="asc"``: oldest first), from after the one `after`
        names, at most `limit`, only those of `purpose` if given."""
        check_limit(limit)
        if order not in ("asc", "desc"):
            raise RequestError(400, f"order must be asc or desc; got {order!r}", param="order")
        ids = [i.decode() for i in self.client.zrange(self.index, 0, -1, desc=order == "desc")]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        data = []
        for start in range(0, len(ids), LIST_CHUNK):
            for obj in self._objects(ids[start : start + LIST_CHUNK]):
                if purpose is None or obj["purpose"] == purpose:
                    data.append(obj)
            if len(data) > limit:
                break
        return list_object(data[:limit], len(data) > limit)

    def _objects(self, ids: list[str]) -> list[dict[str, Any]]:
        """The file objects of `ids`, in order, leaving out any deleted meanwhile."""
        pipe = self.client.pipeline(transaction=False)
        for file_id in ids:
            pipe.hget(self.key(file_id), "object")
        return [json.loads(raw) for raw in pipe.execute() if raw is not None]
