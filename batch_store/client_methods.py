"""OpenAI's Batch API for programs that talk to Redis directly: `Client`'s batch methods.

    with Client("redis://localhost:6379") as client:
        upload = client.upload_batch_file("requests.jsonl")
        batch = client.create_batch(upload["id"], "/v1/chat/completions")
        client.wait_batch(batch["id"])
        output, errors = client.batch_results(batch["id"])

Thin wrappers over the stores the ingress serves `/v1/files` and `/v1/batches` from
(batch_store/files.py, batch_store/batches.py): the same objects, as dicts, and the same checks, a
refused call raising `RequestError` (status 404 for an unknown file or batch). Only the
blocking `Client` has them: the stores are blocking, and `AsyncClient` users can run these
calls in a thread.

A direct client reaches Redis, so no API key scopes it: it sees every owner's files and
batches, and what it makes is the single-tenant owner's (``OPEN_OWNER``, what the ingress
serves with no API keys configured). Set `batch_owner` to act as one owner instead
(stages/ingress/tenancy/ownership.py names them).

A batch is only stored here; the ingress replicas run it (stages/ingress/batches/runner.py),
so a deployment needs at least one ingress for a batch to leave ``validating``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_store.batches import ENDED, BatchStore
from batch_store.files import FileStore
from batch_store.input_file import ENDPOINTS
from jobs.errors import RequestError

if TYPE_CHECKING:
    import redis

    from runtime.config import BusConfig


def endpoint_of(content: bytes) -> str:
    """The endpoint a batch file asks for: its first line's ``url`` (every line must have
    the batch's). ValueError when that line has none of the batch endpoints."""
    first = next((line for line in content.splitlines() if line.strip()), b"")
    try:
        url = json.loads(first).get("url")
    except (ValueError, AttributeError):
        url = None
    if url not in ENDPOINTS:
        raise ValueError(f"the file's first line has no url of {list(ENDPOINTS)}: give the "
                         "endpoint")  # fmt: skip
    return url


def jsonl_lines(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.splitlines() if line.strip()]


class BatchMethods:
    """The batch half of `Client`: needs a connection to the home shard (`home_redis`, a
    Redis Cluster's first; the server itself otherwise) and its names (`home_config`)."""

    home_redis: redis.Redis
    home_config: BusConfig
    batch_owner: str | None = None  # None: every owner's (see the module docstring)

    def _files(self) -> FileStore:
        return FileStore(self.home_redis, self.home_config, self.batch_owner)

    def _batches(self) -> BatchStore:
        return BatchStore(self.home_redis, self.home_config, owner=self.batch_owner)

    def upload_batch_file(
        self,
        file: str | os.PathLike[str] | bytes,
        filename: str | None = None,
        expires_after: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Store a JSONL batch input (a path, or its bytes); returns its file object.
        `expires_after` is OpenAI's ``{"anchor": "created_at", "seconds": n}``."""
        if isinstance(file, bytes):
            content, name = file, filename or "batch.jsonl"
        else:
            content, name = Path(file).read_bytes(), filename or Path(file).name
        return self._files().create(content, name, "batch", expires_after)

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A batch of the uploaded file's lines, in status ``validating``."""
        return self._batches().create(input_file_id, endpoint, completion_window, metadata)

    def batch(self, batch_id: str) -> dict[str, Any]:
        """The batch object, with its live ``request_counts``."""
        return self._batches().get(batch_id)

    def list_batches(self, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """OpenAI's list object of batches, newest first, from after the one `after` names."""
        return self._batches().list(after=after, limit=limit)

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        """Ask the batch to stop (status ``cancelling``); it ends ``cancelled`` with the
        lines that finished in its files."""
        return self._batches().cancel(batch_id)

    def file_content(self, file_id: str) -> bytes:
        """A file's bytes: an input, or a batch's ``output_file_id`` or ``error_file_id``."""
        return self._files().content(file_id)

    def wait_batch(
        self, batch_id: str, timeout: float | None = None, poll_s: float = 1.0
    ) -> dict[str, Any]:
        """The batch once it has ended; TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (batch := self.batch(batch_id))["status"] not in ENDED:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch {batch_id} is still {batch['status']}")
            time.sleep(poll_s)
        return batch

    def batch_results(self, batch_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(output lines, error lines) of an ended batch, parsed, in input order.

        RequestError (400, code ``invalid_state``) while it runs: its files are written when
        it ends."""
        batch = self.batch(batch_id)
        if batch["status"] not in ENDED:
            raise RequestError(400, f"batch {batch_id} is {batch['status']}: its results are "
                               "written when it ends", param="batch_id",
                               code="invalid_state")  # fmt: skip

        def lines(file_id: str | None) -> list[dict[str, Any]]:
            return jsonl_lines(self.file_content(file_id)) if file_id else []

        return lines(batch["output_file_id"]), lines(batch["error_file_id"])
