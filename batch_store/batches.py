"""OpenAI's batches, kept in Redis: their objects, their lines' results, and the lease a
runner holds on each.

A batch is ``<p>:batch:<id>`` (its object, JSON, changed only under WATCH), listed in the
sorted set ``<p>:batches`` and, until it ends, in the set ``<p>:batches:active`` that
runners (stages/ingress/batches/runner.py) take batches from. Each line's result is one field
of ``<p>:batch:<id>:out`` or ``:err``, keyed by its line number and written with HSETNX, so
a line is answered once however often it runs (a runner that died mid-line, one whose lease
lapsed); the output and error files are made from those hashes, in line order, when the
batch ends; then the hashes expire after ``batch_result_ttl_s``, the batch's counts kept in
its object, which expires with the batch's output files (lists forget it when they meet
it gone). ``:inflight`` names the request each line has running, which a runner taking a
dead runner's batch aborts before it runs those lines again; ``:lease`` is the runner's.

A batch has an owner, as a file has (batch_store/files.py): a store made for an owner sees
only that owner's batches (another's is a 404 to read or cancel; ``<p>:owner:<o>:batches``
lists its own; ``:batches:active`` those not yet ended, at most
``max_active_batches_per_owner``) and takes only that owner's files as input. Its output
and error files are its owner's, under random ids chosen once when it finalizes, and expire
after its ``output_expires_after`` or ``file_expiry_s``.

Statuses follow OpenAI's: validating → in_progress → finalizing → completed, or failed (the
file is not a batch), cancelling → cancelled, expired (past its completion window).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from batch_store.files import (
    OPEN_OWNER,
    FileStore,
    check_limit,
    expiry_seconds,
    list_object,
    new_file_id,
    not_found,
)
from batch_store.input_file import check_endpoint
from batch_store.metadata import check_metadata
from jobs.errors import RequestError
from runtime.config import BusConfig

COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's one window
# A batch line's scheduling class at least (lower is served first; requests default to 0),
# so batches use the capacity interactive requests leave and give way to them.
BATCH_PRIORITY = 1
# Kept with a batch, not in OpenAI's object: its lines, whose key made it (its fair share and
# limits), who sees it, its files' ids and expiry, and its counts once its hashes may expire.
HIDDEN = ("total", "tenant", "owner", "file_ids", "output_expires_s", "counts")
ENDED = ("completed", "failed", "expired", "cancelled")
TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")  # fmt: skip

# Lease scripts: only the holder renews or drops its lease.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"  # noqa: E501
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"  # noqa: E501
)


def result_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An output (or error) file line for a request that ran: its HTTP status and body."""
    request_id = body.get("id") if status == 200 else None
    return {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}  # fmt: skip


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error file line for a line that could not run."""
    return {"id": "batch_req_" + uuid.uuid4().hex[:24], "custom_id": custom_id,
            "response": None, "error": {"code": code, "message": message}}  # fmt: skip


class BatchStore:
    def __init__(self, client: redis.Redis, config: BusConfig, files: FileStore | None = None,
                 owner: str | None = None) -> None:  # fmt: skip
        """The batches `owner` sees (every batch when None), taking input from `files`
        (by default that owner's)."""
        self.client = client
        self.config = config
        self.owner = owner
        self.files = files if files is not None else FileStore(client, config, owner)
        self.index = config.key_name("batches")
        self.active = config.key_name("batches", "active")

    def key(self, batch_id: str, part: str = "") -> str:
        return self.config.key_name("batch", batch_id, *([part] if part else []))

    def owner_index(self, owner: str) -> str:
        return self.config.key_name("owner", owner, "batches")

    def owner_active(self, owner: str) -> str:
        """The owner's batches not yet ended (a member may outlive its batch's end: the
        active set, the runners', has the last word)."""
        return self.config.key_name("owner", owner, "batches", "active")

    # ---- what a user does -----------------------------------------------------------------

    def create(self, input_file_id: Any, endpoint: Any, completion_window: Any = "24h",
               metadata: Any = None, tenant: str | None = None,
               output_expires_after: Any = None) -> dict[str, Any]:  # fmt: skip
        """A new batch of this store's owner; `tenant` (whose key made it) is kept for its
        lines' fair share and limits, and not shown."""
        check_endpoint(endpoint)
        output_expires_s = expiry_seconds(output_expires_after, "output_expires_after")
        if completion_window not in COMPLETION_WINDOWS:
            raise RequestError(400, f"completion_window must be one of "
                               f"{list(COMPLETION_WINDOWS)}; got {completion_window!r}",
                               param="completion_window", code="invalid_value")  # fmt: skip
        check_metadata(metadata)
        if not isinstance(input_file_id, str):
            raise RequestError(400, "input_file_id must be a file id", param="input_file_id")
        source = self.files.get(input_file_id)
        if source["purpose"] != "batch":
            raise RequestError(400, f"file {input_file_id} has purpose {source['purpose']!r}, "
                               "not 'batch'", param="input_file_id")  # fmt: skip
        now = int(time.time())
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        obj = {
            "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "expires_at": now + COMPLETION_WINDOWS[completion_window],
            **dict.fromkeys(TIMESTAMPS), "total": 0, "metadata": metadata, "tenant": tenant,
            "owner": self.owner or OPEN_OWNER, "output_expires_s": output_expires_s,
        }  # fmt: skip
        created = time.time()  # finer than created_at: the list order
        owner_active = self.owner_active(obj["owner"])
        with self.client.pipeline(transaction=True) as pipe:
            while True:  # WATCH the owner's active set: two creates cannot take the last room
                try:
                    pipe.watch(owner_active)
                    ended = self._check_active_room(pipe, owner_active)
                    pipe.multi()
                    pipe.set(self.key(batch_id), json.dumps(obj))
                    pipe.zadd(self.index, {batch_id: created})
                    pipe.zadd(self.owner_index(obj["owner"]), {batch_id: created})
                    pipe.sadd(self.active, batch_id)
                    pipe.sadd(owner_active, batch_id)
                    if ended:
                        pipe.srem(owner_active, *ended)
                    pipe.execute()
                    return self._view(obj)
                except redis.WatchError:
                    continue

    def _check_active_room(self, pipe: redis.client.Pipeline, owner_active: str) -> list[str]:
        """Refuse a batch past the owner's not-yet-ended ones (runners pick among every
        owner's: without a bound one owner's thousands would crowd out the others' and make
        every poll long); the ids its set still holds of batches that ended meanwhile."""
        members = [m.decode() for m in pipe.smembers(owner_active)]
        running = pipe.smismember(self.active, members) if members else []
        ended = [m for m, live in zip(members, running, strict=True) if not live]
        most = self.config.max_active_batches_per_owner
        if len(members) - len(ended) >= most:
            raise RequestError(429, f"you have {most} batches not yet ended, the most allowed "
                               "(max_active_batches_per_owner); wait for one to end or cancel one",
                               param="input_file_id", code="too_many_active_batches")  # fmt: skip
        return ended

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._view(self._load(batch_id))

    def list(self, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """This store's batches newest first, from after the one `after` names."""
        check_limit(limit, 100)
        index = self.index if self.owner is None else self.owner_index(self.owner)
        ids = [i.decode() for i in self.client.zrange(index, 0, -1, desc=True)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page, gone = [], []
        for start in range(0, len(ids), limit + 1):  # until a page and one more are found
            wanted = ids[start : start + limit + 1]
            for batch_id, raw in zip(wanted, self.client.mget([self.key(i) for i in wanted]),
                                     strict=True):  # fmt: skip
                if raw is None:
                    gone.append(batch_id)  # expired with its files
                else:
                    page.append(self._view(json.loads(raw)))
            if len(page) > limit:
                break
        if gone:  # the indexes forget what expired (another owner's, on its own reads)
            pipe = self.client.pipeline(transaction=False)
            for read in {index, self.index}:  # the index every batch is in, too
                pipe.zrem(read, *gone)
            pipe.execute()
        return list_object(page[:limit], len(page) > limit)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """Ask the batch to stop: its runner aborts what runs and ends it as cancelled, with
        the lines that finished in its files."""

        def cancelling(obj: dict[str, Any]) -> None:
            if obj["status"] in ENDED or obj["status"] == "finalizing":
                raise RequestError(400, f"cannot cancel a batch with status {obj['status']}",
                                   param="batch_id", code="invalid_state")  # fmt: skip
            if obj["status"] != "cancelling":
                obj["status"], obj["cancelling_at"] = "cancelling", int(time.time())

        return self._view(self._update(batch_id, cancelling))

    # ---- what a runner does ---------------------------------------------------------------

    def active_ids(self) -> list[str]:
        """The batches to run. A member that is not UTF-8 names no batch (create() adds
        ids of text): it leaves the set rather than stop every runner's poll."""
        ids = []
        for member in self.client.smembers(self.active):
            try:
                ids.append(member.decode())
            except UnicodeDecodeError:
                self.client.srem(self.active, member)
        return sorted(ids)

    def retire_unreadable(self, batch_id: str) -> None:
        """Take out of the runners' set a batch whose object is gone or unreadable (a key
        that expired, or that something other than this store wrote): nothing can run it."""
        self.client.srem(self.active, batch_id)

    def take_lease(self, batch_id: str, owner: str, ttl_ms: int) -> bool:
        return bool(self.client.set(self.key(batch_id, "lease"), owner, nx=True, px=ttl_ms))

    def renew_lease(self, batch_id: str, owner: str, ttl_ms: int) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.key(batch_id, "lease"), owner, ttl_ms))

    def release_lease(self, batch_id: str, owner: str) -> None:
        self.client.eval(_RELEASE, 1, self.key(batch_id, "lease"), owner)

    def raw(self, batch_id: str) -> dict[str, Any]:
        """The stored object, with its `total` of lines and its status as they are."""
        return self._load(batch_id)

    def begin(self, batch_id: str, total: int, line_errors: dict[int, dict[str, Any]]) -> None:
        """Validated: its lines counted, the bad ones in the error file; now in progress
        (unless cancelled meanwhile)."""
        if line_errors:
            mapping = {n: json.dumps(e) for n, e in line_errors.items()}
            self.client.hset(self.key(batch_id, "err"), mapping=mapping)

        def started(obj: dict[str, Any]) -> None:
            obj["total"] = total
            if obj["status"] == "validating":
                obj["status"], obj["in_progress_at"] = "in_progress", int(time.time())

        self._update(batch_id, started)

    def fail(self, batch_id: str, error: RequestError) -> None:
        """The input file is not a batch: the batch fails with OpenAI's `errors` list."""

        def failed(obj: dict[str, Any]) -> None:
            obj["status"], obj["failed_at"] = "failed", int(time.time())
            obj["errors"] = {"object": "list", "data": [
                {"code": error.code, "message": error.message, "param": error.param,
                 "line": None}]}  # fmt: skip

        self._retire(batch_id, self._update(batch_id, failed))

    def done_lines(self, batch_id: str) -> set[int]:
        """The lines with a result already (an earlier runner's included)."""
        return {int(n) for part in ("out", "err")
                for n in self.client.hkeys(self.key(batch_id, part))}  # fmt: skip

    def running(self, batch_id: str, line: int, request_id: str, rids: list[str]) -> None:
        self.client.hset(self.key(batch_id, "inflight"), line, json.dumps([request_id, rids]))

    def stale_requests(self, batch_id: str) -> list[tuple[str, list[str]]]:
        """What an earlier runner had running, (request id, sub-request ids) per line; the
        record is cleared."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hvals(self.key(batch_id, "inflight"))
        pipe.delete(self.key(batch_id, "inflight"))
        values, _ = pipe.execute()
        return [tuple(json.loads(v)) for v in values]  # type: ignore[misc]

    def record(self, batch_id: str, line: int, result: dict[str, Any], ok: bool) -> bool:
        """A line's result, once: False if the line had one already."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(self.key(batch_id, "out" if ok else "err"), line, json.dumps(result))
        pipe.hdel(self.key(batch_id, "inflight"), line)
        first, _ = pipe.execute()
        return bool(first)

    def finish(self, batch_id: str, status: str) -> dict[str, Any]:
        """Write the output and error files (their owner's, under ids drawn once, so a
        second finish rewrites the same two files) and end the batch as `status`."""
        obj = self._update(batch_id, _finalizing)
        file_ids, counts = {}, {}
        for part, purpose in (("out", "batch_output"), ("err", "batch_error")):
            lines = self.client.hgetall(self.key(batch_id, part))
            counts[part] = len(lines)
            if not lines and part == "err":
                continue
            content = b"".join(lines[n] + b"\n" for n in sorted(lines, key=int))
            file_id = obj["file_ids"][part]
            self.files.put(file_id, content, f"{batch_id}_{purpose}.jsonl", purpose,
                           obj.get("output_expires_s"), obj.get("owner"))  # fmt: skip
            file_ids[part] = file_id

        def ended(obj: dict[str, Any]) -> None:
            _stamp(status)(obj)
            obj["output_file_id"] = file_ids.get("out")
            obj["error_file_id"] = file_ids.get("err")
            obj["counts"] = counts

        obj = self._update(batch_id, ended)
        self._retire(batch_id, obj)
        return self._view(obj)

    def _retire(self, batch_id: str, obj: dict[str, Any]) -> None:
        """An ended batch leaves the runners' sets; its results expire in a while, its
        object with its files (a 404 from then on, and gone from lists)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.srem(self.active, batch_id)
        pipe.srem(self.owner_active(obj.get("owner") or OPEN_OWNER), batch_id)
        pipe.expire(self.key(batch_id), obj.get("output_expires_s") or self.config.file_expiry_s)
        pipe.delete(self.key(batch_id, "inflight"))
        for part in ("out", "err"):
            pipe.expire(self.key(batch_id, part), self.config.batch_result_ttl_s)
        pipe.execute()

    # ---- the object -----------------------------------------------------------------------

    def _load(self, batch_id: str) -> dict[str, Any]:
        return self._seen(batch_id, self.client.get(self.key(batch_id)))

    def _seen(self, batch_id: str, raw: bytes | None) -> dict[str, Any]:
        """The stored object, if this store sees it; another owner's is as missing as none."""
        obj = None if raw is None else json.loads(raw)
        if obj is None or (self.owner is not None and obj.get("owner") != self.owner):
            raise not_found("batch", batch_id, "batch_id")
        return obj

    def _update(self, batch_id: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """`change` applied to the stored object atomically (retried if another wrote)."""
        key = self.key(batch_id)
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    obj = self._seen(batch_id, pipe.get(key))
                    change(obj)
                    pipe.multi()
                    pipe.set(key, json.dumps(obj), keepttl=True)  # an ended one's expiry
                    pipe.execute()
                    return obj
                except redis.WatchError:
                    continue

    def _view(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The object as OpenAI shows it, with its live request counts."""
        view = {k: v for k, v in obj.items() if k not in HIDDEN}
        if "counts" in obj:  # ended: its hashes may have expired
            completed, failed = obj["counts"]["out"], obj["counts"]["err"]
        else:
            pipe = self.client.pipeline(transaction=False)
            pipe.hlen(self.key(obj["id"], "out"))
            pipe.hlen(self.key(obj["id"], "err"))
            completed, failed = pipe.execute()
        view["request_counts"] = {"total": obj["total"], "completed": completed,
                                  "failed": failed}  # fmt: skip
        return view


def _finalizing(obj: dict[str, Any]) -> None:
    """Stamped finalizing, with its files' ids drawn once: a runner finishing it again
    rewrites the same two files."""
    _stamp("finalizing")(obj)
    obj.setdefault("file_ids", {"out": new_file_id(), "err": new_file_id()})


def _stamp(status: str) -> Callable[[dict[str, Any]], None]:
    def stamp(obj: dict[str, Any]) -> None:
        obj["status"], obj[f"{status}_at"] = status, int(time.time())

    return stamp
