"""Where `streamserve batch` finds the batches: Redis through `bus.client.Client`'s batch
methods, or an ingress's `/v1/files` and `/v1/batches` (the way in where Redis is out of
reach, or to `streamserve up`'s private server). Both answer the same objects as dicts and
fail with `BatchUnavailable`, one line for the user.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import quote, urlencode, urlsplit

import redis

from bus.access import redacted
from bus.client import Client
from cli.status import INGRESS_URL_ENV
from jobs.errors import RequestError
from runtime.config import BusConfig
from stages.ingress.tenancy.auth import api_keys_from_env

# Long enough to move a big input or output file, short enough that a dead server is told.
TIMEOUT_S = 60.0


class BatchUnavailable(Exception):
    """A call that failed; the message is one line for the user. `transient`: the server
    could not be reached (worth another try), not a refusal."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class BatchSource(Protocol):
    where: str

    def upload(self, content: bytes, filename: str) -> dict[str, Any]: ...
    def create(self, file_id: str, endpoint: str, window: str,
               metadata: dict[str, str] | None) -> dict[str, Any]: ...  # fmt: skip
    def get(self, batch_id: str) -> dict[str, Any]: ...
    def cancel(self, batch_id: str) -> dict[str, Any]: ...
    def list(self, limit: int, after: str | None) -> dict[str, Any]: ...
    def content(self, file_id: str) -> bytes: ...


def choose_source(
    redis_url: str | None, ingress_url: str | None, environ: Mapping[str, str]
) -> BatchSource:
    """As `streamserve status` chooses: the flags, then $STREAMSERVE_URL, then $REDIS_URL.
    ValueError when there is none, or the URL is not one."""
    if ingress_url is None and redis_url is None:
        ingress_url = environ.get(INGRESS_URL_ENV, "").strip() or None
    if ingress_url is not None:
        return IngressSource(ingress_url, environ)
    config = BusConfig.from_env(environ, **({"redis_url": redis_url} if redis_url else {}))
    if config.redis_url is None:
        raise ValueError(
            "no deployment to talk to: give --redis-url (or set REDIS_URL) or an ingress's "
            f"--url (or set {INGRESS_URL_ENV})"
        )
    return RedisSource(config)


class RedisSource:
    def __init__(self, config: BusConfig) -> None:
        self.config = config
        self.where = redacted(config.redis_url)
        # Made at the first call: it looks at the server (a Redis Cluster's shards), and
        # a command's own arguments are checked before anything is reached.
        self._client: Client | None = None

    def _call(self, method: str, *args: Any) -> Any:
        try:
            if self._client is None:
                self._client = Client(config=self.config)
            return getattr(self._client, method)(*args)
        except RequestError as exc:
            raise BatchUnavailable(exc.message) from None
        except redis.RedisError as exc:
            raise BatchUnavailable(f"cannot reach Redis at {self.where}: {exc}", True) from None

    def upload(self, content: bytes, filename: str) -> dict[str, Any]:
        return self._call("upload_batch_file", content, filename)

    def create(self, file_id: str, endpoint: str, window: str,
               metadata: dict[str, str] | None) -> dict[str, Any]:  # fmt: skip
        return self._call("create_batch", file_id, endpoint, window, metadata)

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._call("batch", batch_id)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._call("cancel_batch", batch_id)

    def list(self, limit: int, after: str | None) -> dict[str, Any]:
        return self._call("list_batches", after, limit)

    def content(self, file_id: str) -> bytes:
        return self._call("file_content", file_id)


class IngressSource:
    def __init__(self, url: str, environ: Mapping[str, str]) -> None:
        if urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"--url must be an ingress's http:// or https:// URL; got {url!r}")
        self.where = url.rstrip("/")
        self.headers = {}
        keys = api_keys_from_env(environ)
        if keys:  # these routes want the key when the ingress has keys set
            self.headers["Authorization"] = f"Bearer {keys[0]}"

    def _request(self, method: str, path: str, body: bytes | None = None,
                 content_type: str | None = None) -> bytes:  # fmt: skip
        url = self.where + path
        headers = dict(self.headers, **({"Content-Type": content_type} if content_type else {}))
        request = urllib.request.Request(url, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            message = f"{url} answered {exc.code}: {_error_message(exc)}"
            raise BatchUnavailable(message, exc.code >= 500) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise BatchUnavailable(f"cannot reach {url}: {reason}", True) from None

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        return self._decode(path, self._request(method, path, data, "application/json"))

    def _decode(self, path: str, raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except ValueError:
            raise BatchUnavailable(f"{self.where}{path} did not answer JSON") from None

    def upload(self, content: bytes, filename: str) -> dict[str, Any]:
        body, content_type = multipart({"purpose": "batch"}, "file", filename, content)
        return self._decode("/v1/files", self._request("POST", "/v1/files", body, content_type))

    def create(self, file_id: str, endpoint: str, window: str,
               metadata: dict[str, str] | None) -> dict[str, Any]:  # fmt: skip
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window}
        if metadata is not None:
            body["metadata"] = metadata
        return self._json("POST", "/v1/batches", body)

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/batches/{quote(batch_id, safe='')}")

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/batches/{quote(batch_id, safe='')}/cancel")

    def list(self, limit: int, after: str | None) -> dict[str, Any]:
        query = {"limit": limit, **({"after": after} if after else {})}
        return self._json("GET", f"/v1/batches?{urlencode(query)}")

    def content(self, file_id: str) -> bytes:
        return self._request("GET", f"/v1/files/{quote(file_id, safe='')}/content")


def multipart(
    fields: dict[str, str], name: str, filename: str, content: bytes
) -> tuple[bytes, str]:
    """A multipart/form-data body of text `fields` and one file, and its Content-Type."""
    boundary = "streamserve-" + uuid.uuid4().hex
    safe_name = filename.replace('"', "_").replace("\r", "_").replace("\n", "_")
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode()
        for key, value in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
        f'filename="{safe_name}"\r\nContent-Type: application/jsonl\r\n\r\n'.encode()
        + content
        + b"\r\n"
    )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _error_message(error: urllib.error.HTTPError) -> str:
    """The OpenAI-style body's message, else the HTTP reason."""
    try:
        return json.loads(error.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return str(error.reason)
