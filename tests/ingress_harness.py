"""The real ingress and a scripted upstream, for tests of the HTTP side and the direct client.

`RunningIngress` serves `create_app` on a free port from a thread of its own. `Upstream`
plays tokenizer, router, worker and detokenizer at once: it reads each job from the real
requests stream (and a prompt of token ids from the tokenized stream, where the ingress
sends it) and writes the replies a test's script returns (in whatever order, duplicated or
failing) to the request's real reply stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from jobs.protocol import (
    Finish,
    GenerateRequest,
    Heartbeat,
    TextDelta,
    TokenizedRequest,
    decode,
)
from jobs.token_records import pack_floats
from jobs.wire import ENTRY_FIELD, Message, ProtocolError, encode, job_payloads
from runtime.config import BusConfig
from stages.ingress.server import create_app, serve
from stages.ingress.tenancy.tenants import KEY_LIMITS_ENV, tenants_from_env

MODEL = "test-model"
START_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 10.0

Script = Callable[[GenerateRequest], Iterable[Message]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_raw(
    url: str, body: dict, headers: dict[str, str], timeout: float = 5
) -> tuple[int, bytes]:
    """POST a JSON body with extra headers; (status, raw body), an HTTP error's included."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", **headers},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def add_worker(client: redis.Redis, config: BusConfig, worker_id: str = "w0") -> None:
    """A live worker as the router and the ingress see one: listed, with a heartbeat key."""
    beat = Heartbeat(worker_id, config.worker_stream(worker_id), MODEL, 0, 0, 1000, 1000, 0,
                     time.time())  # fmt: skip
    client.sadd(config.workers_key(), worker_id)
    client.set(config.heartbeat_key(worker_id), encode(beat), ex=60)


def deltas(
    rid: str,
    pieces: list[tuple[str, list[int]]],
    reason: str = "stop",
    matched: str | int | None = None,
    prompt_tokens: int = 7,
    cached_tokens: int = 0,
) -> list[TextDelta]:
    """In-order deltas of (text, ids) pieces; the last carries the finish."""
    out, seq = [], 0
    for text, ids in pieces:
        out.append(TextDelta(rid, seq, ids, text))
        seq += len(ids)
    finish = Finish(reason, matched, prompt_tokens, seq, cached_tokens)
    out[-1].finish = finish.to_wire()
    return out


def embedding_delta(rid: str, vector: list[float], prompt_tokens: int = 7) -> TextDelta:
    """An embedding job's one reply: its vector (packed float32) and its finish."""
    finish = Finish("stop", None, prompt_tokens, 0)
    return TextDelta(rid, 0, [], None, finish.to_wire(), embedding=pack_floats(vector))


def _requests_in(fields: dict[bytes, bytes]) -> list[GenerateRequest | TokenizedRequest]:
    """The jobs an entry carries (one, or a bundle's: jobs/wire.py), filler left out."""
    requests = []
    try:
        payloads = job_payloads(fields)
    except ProtocolError:
        return []
    for payload in payloads:
        try:
            requests.append(decode(payload, GenerateRequest, TokenizedRequest))
        except ProtocolError:
            continue  # filler a test put on the stream
    return requests


def _as_submitted(job: GenerateRequest | TokenizedRequest) -> GenerateRequest:
    """A job as the ingress submitted it: one it sent the router (a prompt of token ids)
    in the form a script reads, its input_ids as its prompt."""
    if isinstance(job, GenerateRequest):
        return job
    return GenerateRequest(job.rid, job.reply_to, input_ids=job.input_ids, sampling=job.sampling,
                           created=job.created, tenant=job.tenant, weight=job.weight,
                           priority=job.priority, v=job.v, bundle_replies=job.bundle_replies,
                           pooling=job.pooling, tag=job.tag,
                           text_only=job.text_only)  # fmt: skip


class Upstream:
    """Answers every job the ingress queues (on the requests stream, and a prompt of token
    ids on the tokenized stream) with what `script` returns for it."""

    def __init__(self, redis_url: str, config: BusConfig, script: Script) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.config = config
        self.script = script
        self.requests: list[GenerateRequest] = []
        self.routed: list[str] = []  # the rids of those read on the tokenized stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = {self.config.requests_stream(): "0-0", self.config.tokenized_stream(): "0-0"}
        while not self._stop.is_set():
            response = self.client.xread(last, block=50)
            pipe = self.client.pipeline(transaction=False)
            for stream, entries in response or []:
                for entry_id, fields in entries:
                    last[stream.decode()] = entry_id
                    for job in _requests_in(fields):
                        request = _as_submitted(job)
                        if isinstance(job, TokenizedRequest):
                            self.routed.append(job.rid)
                        self.requests.append(request)
                        for message in self.script(request):
                            pipe.xadd(request.reply_to, {ENTRY_FIELD: encode(message)})
            pipe.execute()

    def __enter__(self) -> Upstream:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def _await_chain(coro: Any) -> str:
    """Where a suspended coroutine waits, outermost first (a task's own stack stops at its
    first frame)."""
    at = []
    while coro is not None and len(at) < 12:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        at.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} "
                  f"{frame.f_code.co_name}")  # fmt: skip
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " -> ".join(at)


class RunningIngress:
    def __init__(self, redis_url: str, config: BusConfig | None = None, **options: Any) -> None:
        self.config = config or BusConfig(redis_url=redis_url)  # a config: a Cluster's shard
        self.options = {"model": MODEL, **options}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.app = create_app(self.config, **self.options)
        await serve(self.app, host="127.0.0.1", port=self.port, stop=self._stop,
                    shutdown_timeout_s=0.5)  # fmt: skip

    def __enter__(self) -> RunningIngress:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if time.monotonic() > deadline or not self._thread.is_alive():
                    raise RuntimeError("the ingress did not start") from None
                time.sleep(0.01)

    def __exit__(self, *exc_info: object) -> None:
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)  # SIGTERM, as serve() takes it
        self._thread.join(timeout=STOP_TIMEOUT_S)
        if self._thread.is_alive() and self._loop is not None:
            # A replica left running would go on taking batches and background responses
            # from the session's Redis under its own settings, in later tests: say where it
            # hung, then stop its loop (asyncio.run ends with an error, the thread with it).
            frame = sys._current_frames().get(self._thread.ident)
            where = "".join(traceback.format_stack(frame)[-8:]) if frame else "?"
            warnings.warn(f"the ingress on port {self.port} did not stop in {STOP_TIMEOUT_S} "
                          f"s; stopping its loop. It hung at:\n{where}\nits tasks, awaiting:\n"
                          f"{self._awaiting()}", stacklevel=2)  # fmt: skip
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=STOP_TIMEOUT_S)

    def _awaiting(self) -> str:
        """Where each task of the ingress's loop waits (the thread's own stack shows only
        the loop's select): what a stop that never ends is waiting for."""

        async def stacks() -> str:
            lines = []
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    lines.append(f"  {task.get_name()}: {_await_chain(task.get_coro())}")
            return "\n".join(lines)

        try:
            return asyncio.run_coroutine_threadsafe(stacks(), self._loop).result(timeout=2)
        except Exception as exc:  # a diagnosis only: never the test's failure
            return f"  ? ({exc!r})"

    @property
    def state(self):
        from stages.ingress.state import STATE

        return self.app[STATE]

    def request(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, _, data = self.request("POST", path, body)
        return status, json.loads(data)


@contextmanager
def keyed_ingress(
    redis_url: str, keys: Iterable[str], limits: dict[str, Any], script: Callable
) -> Iterator[RunningIngress]:
    """An ingress taking `keys`, with `limits` as STREAMSERVE_KEY_LIMITS, a live worker and an
    Upstream answering with `script`; the server has `upstream` and `redis` set."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    tenants = tenants_from_env({KEY_LIMITS_ENV: json.dumps(limits)})
    with RunningIngress(redis_url, api_keys=keys, tenants=tenants) as server:
        add_worker(client, server.config)
        with Upstream(redis_url, server.config, script) as upstream:
            server.upstream = upstream
            server.redis = client
            yield server
    client.close()
