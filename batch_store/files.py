"""OpenAI's files, kept in Redis: what `/v1/files` serves and what batches read and write.

A file is one hash, ``<p>:file:<id>`` with its object (JSON), its bytes and its owner, and
an entry in the sorted set ``<p>:files`` (by creation time) that lists them all. Redis is
the only shared state (docs/ARCHITECTURE.md): any ingress replica serves any file, and with
append-only persistence a file outlives a restart of Redis itself.

Every file has an owner (the tenant of the API key that made it: stages/ingress/tenancy/)
and is seen only through that owner's store: another owner's file is a 404, as a missing
one is. A store made without an owner (single-tenant mode, a direct client) sees every file
and makes files owned by ``OPEN_OWNER``. Per owner, ``<p>:owner:<o>:files`` lists its files
by creation time and ``<p>:owner:<o>:file-sizes`` holds each one's bytes and expiry, which
bound what it keeps (``max_files_per_owner``, ``max_bytes_per_owner``).

Every file expires (``expires_after`` on upload, else ``file_expiry_s``): Redis drops its
hash at ``expires_at`` and the indexes forget it the next time they are read, skipping what
is gone. Users upload files with purpose ``batch``; a batch writes its output and error
files with purposes ``batch_output`` and ``batch_error``. Blocking calls on a redis-py
client: the ingress runs them on its executor.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from jobs.errors import RequestError
from runtime.config import BusConfig

UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSES = ("batch_output", "batch_error")
MAX_LIST_LIMIT = 10_000
LIST_CHUNK = 100  # objects read per round trip while listing
OPEN_OWNER = "default"  # what an unscoped store makes (no tenant id is "default")
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)  # OpenAI's range for expires_after.seconds


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


def new_file_id() -> str:
    """96 random bits: a file id tells nothing of its batch, and cannot be guessed."""
    return "file-" + uuid.uuid4().hex[:24]


def expiry_seconds(expires_after: Any, param: str = "expires_after") -> int | None:
    """The seconds of OpenAI's ``{"anchor": "created_at", "seconds": n}``; None for None."""
    if expires_after is None:
        return None
    if not isinstance(expires_after, dict) or set(expires_after) != {"anchor", "seconds"}:
        raise RequestError(400, f"{param} must be an object with anchor and seconds",
                           param=param, code="invalid_value")  # fmt: skip
    if expires_after["anchor"] != "created_at":
        raise RequestError(400, f"{param}[anchor] must be 'created_at'; got "
                           f"{expires_after['anchor']!r}", param=f"{param}[anchor]",
                           code="invalid_value")  # fmt: skip
    seconds, (least, most) = expires_after["seconds"], EXPIRES_AFTER_S
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not least <= seconds <= most:
        raise RequestError(400, f"{param}[seconds] must be an integer between {least} and "
                           f"{most}; got {seconds!r}", param=f"{param}[seconds]",
                           code="invalid_value")  # fmt: skip
    return seconds


class FileStore:
    """The files `owner` sees (every file when None): see the module docstring."""

    def __init__(self, client: redis.Redis, config: BusConfig, owner: str | None = None) -> None:
        self.client = client
        self.config = config
        self.owner = owner
        self.max_bytes = config.max_file_bytes
        self.index = config.key_name("files")

    def key(self, file_id: str) -> str:
        return self.config.key_name("file", file_id)

    def owner_index(self, owner: str) -> str:
        return self.config.key_name("owner", owner, "files")

    def owner_sizes(self, owner: str) -> str:
        return self.config.key_name("owner", owner, "file-sizes")

    def create(self, content: bytes, filename: str, purpose: str,
               expires_after: Any = None) -> dict[str, Any]:  # fmt: skip
        """A user's upload: checked, stored within its owner's bounds, its object returned."""
        if purpose not in UPLOAD_PURPOSES:
            raise RequestError(400, f"purpose must be one of {list(UPLOAD_PURPOSES)}; got "
                               f"{purpose!r}", param="purpose")  # fmt: skip
        seconds = expiry_seconds(expires_after)
        if len(content) > self.max_bytes:
            message = f"the file has {len(content)} bytes, over the limit of {self.max_bytes}"
            raise RequestError(413, message, param="file", code="file_too_large")
        if not content:
            raise RequestError(400, "the file is empty", param="file")
        return self.put(new_file_id(), content, filename, purpose, seconds, refuse_over=True)

    def put(self, file_id: str, content: bytes, filename: str, purpose: str,
            expires_in_s: int | None = None, owner: str | None = None,
            refuse_over: bool = False) -> dict[str, Any]:  # fmt: skip
        """Store `content` under `file_id` for `owner` (default: this store's), replacing
        what was there (a runner finishing a batch again rewrites the same files). With
        `refuse_over`, a file past its owner's bounds is a 4xx; a batch's own files are
        never refused, only counted."""
        owner = owner or self.owner or OPEN_OWNER
        created = time.time()
        expires_at = int(created) + (expires_in_s or self.config.file_expiry_s)
        obj = {
            "id": file_id, "object": "file", "bytes": len(content), "created_at": int(created),
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": expires_at, "status_details": None,
        }  # fmt: skip
        sizes = self.owner_sizes(owner)
        with self.client.pipeline(transaction=True) as pipe:
            while True:  # WATCH the owner's sizes: two uploads cannot both take the last room
                try:
                    pipe.watch(sizes)
                    held, gone = _held(pipe.hgetall(sizes), file_id, created)
                    if refuse_over:
                        self._check_room(held, len(content))
                    pipe.multi()
                    if gone:
                        self._forget(pipe, owner, gone)
                    key = self.key(file_id)
                    pipe.hset(key, mapping={"object": json.dumps(obj), "content": content,
                                            "owner": owner})  # fmt: skip
                    pipe.expireat(key, expires_at)
                    pipe.zadd(self.index, {file_id: created})  # finer than created_at: order
                    pipe.zadd(self.owner_index(owner), {file_id: created})
                    pipe.hset(sizes, file_id, f"{len(content)} {expires_at}")
                    pipe.execute()
                    return obj
                except redis.WatchError:
                    continue

    def _check_room(self, held: dict[str, int], size: int) -> None:
        most_files, most_bytes = self.config.max_files_per_owner, self.config.max_bytes_per_owner
        if len(held) + 1 > most_files:
            raise RequestError(400, f"you keep {len(held)} files, the most allowed "
                               f"(max_files_per_owner {most_files}); delete some first",
                               param="file", code="too_many_files")  # fmt: skip
        total = sum(held.values())
        if total + size > most_bytes:
            raise RequestError(400, f"your files hold {total} bytes; this one's {size} more "
                               f"would pass the {most_bytes} allowed (max_bytes_per_owner)",
                               param="file", code="storage_quota_exceeded")  # fmt: skip

    def get(self, file_id: str) -> dict[str, Any]:
        return json.loads(self._field(file_id, "object"))

    def content(self, file_id: str) -> bytes:
        return self._field(file_id, "content")

    def _field(self, file_id: str, name: str) -> bytes:
        """A field of a file this store sees; another owner's is as missing as no file."""
        value, owner = self.client.hmget(self.key(file_id), [name, "owner"])
        if value is None or not self._sees(owner):
            raise not_found("file", file_id, "file_id")
        return value

    def _sees(self, owner: bytes | None) -> bool:
        return self.owner is None or (owner is not None and owner.decode() == self.owner)

    def delete(self, file_id: str) -> dict[str, Any]:
        owner = self.client.hget(self.key(file_id), "owner")
        if not self._sees(owner):
            raise not_found("file", file_id, "file_id")
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.key(file_id))
        if owner is not None:
            self._forget(pipe, owner.decode(), [file_id])
        else:  # a file from before owners: only the global index has it
            pipe.zrem(self.index, file_id)
        if not pipe.execute()[0]:
            raise not_found("file", file_id, "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    def _forget(self, pipe: redis.client.Pipeline, owner: str, file_ids: list[str]) -> None:
        """Queue the removal of `file_ids` from every index (their hashes are gone or going)."""
        pipe.zrem(self.index, *file_ids)
        pipe.zrem(self.owner_index(owner), *file_ids)
        pipe.hdel(self.owner_sizes(owner), *file_ids)

    def list(self, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             order: str = "desc") -> dict[str, Any]:  # fmt: skip
        """This store's files newest first (``order="asc"``: oldest first), from after the
        one `after` names, at most `limit`, only those of `purpose` if given."""
        check_limit(limit)
        if order not in ("asc", "desc"):
            raise RequestError(400, f"order must be asc or desc; got {order!r}", param="order")
        index = self.index if self.owner is None else self.owner_index(self.owner)
        ids = [i.decode() for i in self.client.zrange(index, 0, -1, desc=order == "desc")]
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
        """The file objects of `ids`, in order; the ids of files gone (expired, deleted
        meanwhile) are dropped from the index read."""
        pipe = self.client.pipeline(transaction=False)
        for file_id in ids:
            pipe.hget(self.key(file_id), "object")
        raws = pipe.execute()
        gone = [file_id for file_id, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            pipe = self.client.pipeline(transaction=True)
            if self.owner is None:
                pipe.zrem(self.index, *gone)  # their owners' indexes forget them on next use
            else:
                self._forget(pipe, self.owner, gone)
            pipe.execute()
        return [json.loads(raw) for raw in raws if raw is not None]


def _held(sizes: dict[bytes, bytes], replaced: str, now: float) -> tuple[dict[str, int], list]:
    """An owner's live files' sizes (less the one being `replaced`), and its expired ids."""
    held, gone = {}, []
    for raw_id, raw in sizes.items():
        file_id = raw_id.decode()
        size, _, expires_at = raw.decode().partition(" ")
        if int(expires_at) <= now:
            gone.append(file_id)
        elif file_id != replaced:
            held[file_id] = int(size)
    return held, gone
