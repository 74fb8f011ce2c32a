"""Direct Redis jobs, without HTTP: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("redis://localhost:6379") as client:
        print(client.generate("Once upon a time", sampling={"max_new_tokens": 16})["text"])
        rids = client.submit_many([{"input_ids": [1, 2, 3]}] * 1000)
        for chunk in client.stream(rids[0]):
            ...

On the wire (jobs/protocol.py has it all): ``submit`` XADDs one entry ``{m: msgpack map}`` to
``<p>:requests`` (``submit_many`` one entry ``{jobs: msgpack array of such maps' bytes}`` per
round trip: jobs/wire.py), a GenerateRequest ``{kind: "generate", rid, reply_to, prompt | messages |
input_ids (packed: uint16s in a msgpack extension where every id fits, else little-endian
int32 bytes; jobs/wire.py), sampling: {SamplingParams fields}, created, bundle_replies: true,
tag}``. The pipeline answers on the client's own ``<p>:reply:client-<uuid>`` stream with
TextDeltas entries ``{kind: "deltas", deltas: [{tag, rid (on the first only), seq, ids, text,
finish?}]}`` (``finish`` on the last one: ``{reason, matched, prompt_tokens,
completion_tokens, cached_tokens}``, with ``draft_tokens, accepted_draft_tokens`` when the
worker speculated; ``tag`` the number this client gave the job: bus/reply_tags.py) or one
ErrorReply ``{kind: "error", rid, status, message, type, param, code}``. A finish of reason
``error`` (the job's own fault found as it ran: ``matched`` says what, ``param`` names the
field) raises `RequestError` as an ErrorReply does.

A submitted job's replies are kept for its `stream` until the request ends or is aborted;
stream (or abort) every job you submit. A job with ``pooling="mean"`` or ``"last"`` is an
embedding job (jobs/requests.py): no sampling, and its one chunk (and `generate`'s result)
holds ``embedding``, the prompt's pooled, L2-normalized hidden states as a list of floats.
`Client` also has OpenAI's Batch API (batch_store/client_methods.py: `upload_batch_file`,
`create_batch`, `batch`, `batch_results`, ...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import redis
import redis.asyncio as aredis

from batch_store.client_methods import BatchMethods
from bus.aborts import publish_abort, publish_abort_async
from bus.async_pool import async_redis, async_timeout
from bus.effects import add_jobs
from bus.replies import AsyncReplyReader, Reply, ReplyReader
from jobs.errors import RequestError
from jobs.protocol import MAX_TOKEN_ID, ErrorReply, GenerateRequest, decode, encode
from jobs.requests import lift_priority
from jobs.sampling_params import wire_sampling
from runtime.cluster import client_shards
from runtime.config import REDIS_URL_ENV, BusConfig

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; annotations are never evaluated here
    from typing_extensions import Unpack

SUBMIT_PIPELINE_SIZE = 1_000  # jobs per round trip in submit_many (bundle entries)
CONNECT_TIMEOUT_S = 5.0


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def new_request(
    reply_to: str,
    prompt: str | None = None,
    *,
    messages: list[dict[str, Any]] | None = None,
    input_ids: list[int] | None = None,
    sampling: Mapping[str, Any] | None = None,
    rid: str | None = None,
    pooling: str | None = None,
) -> GenerateRequest:
    """A checked GenerateRequest (ValueError for a bad one)."""
    if input_ids is not None:
        if isinstance(input_ids, str | bytes | Mapping):
            raise ValueError("input_ids must be a list of token ids")
        input_ids = list(input_ids)
        bad = next((t for t in input_ids if not _is_token_id(t)), None)
        if bad is not None:
            raise ValueError(f"input_ids: {bad!r} is not a token id")
    if sampling is not None and not isinstance(sampling, Mapping):
        raise ValueError(f"sampling must be a mapping; got {type(sampling).__name__}")
    if pooling is not None and sampling:
        raise ValueError("an embedding job (pooling) takes no sampling parameters")
    # Checked and normalised here, where the job enters; its priority travels beside it.
    wire, priority = lift_priority(wire_sampling(sampling)) if pooling is None else ({}, None)
    request = GenerateRequest(
        rid=rid or uuid.uuid4().hex,
        reply_to=reply_to,
        prompt=prompt,
        messages=messages,
        input_ids=input_ids,
        sampling=wire,
        created=time.time(),
        priority=priority,
        bundle_replies=True,  # its ReplyReader reads TextDeltas
        pooling=pooling,
    )
    if pooling is not None:
        request.sampling = {"max_new_tokens": 0}  # the prompt alone must fit the context
    # The checks every stage makes of what it reads (types of prompt, messages, rid...):
    # a job refused here is never queued.
    try:
        decode(encode(request), GenerateRequest)
    except (TypeError, ValueError) as exc:  # msgpack's TypeError: a value it cannot pack
        raise ValueError(f"malformed job: {exc}") from None
    return request


def add_requests(
    pipe: redis.client.Pipeline | aredis.client.Pipeline,
    config: BusConfig,
    requests: Iterable[GenerateRequest],
) -> None:
    """Queue `requests` on the requests stream on `pipe` (sync or async): one bundle entry
    for them all (a plain entry for one alone; jobs/wire.py)."""
    add_jobs(pipe, config.requests_stream(), [encode(request) for request in requests])


def resolve_config(redis_url: str | None, config: BusConfig | None) -> BusConfig:
    """The config to use, with its URL from the argument, else the config, else $REDIS_URL."""
    config = config if config is not None else BusConfig.from_env()
    url = redis_url or config.redis_url or os.environ.get(REDIS_URL_ENV, "").strip()
    if not url:
        raise ValueError(
            f"no Redis URL: pass redis_url, a BusConfig with one, or set {REDIS_URL_ENV}"
        )
    return dataclasses.replace(config, redis_url=url)


class JobOptions(TypedDict, total=False):
    """`submit`'s keyword arguments: what a job asks for besides its prompt."""

    messages: list[dict[str, Any]] | None
    input_ids: list[int] | None
    sampling: Mapping[str, Any] | None
    rid: str | None
    pooling: str | None  # an embedding job's: "mean" or "last"


class JobSpec(JobOptions, total=False):
    """One job as `submit_many` takes it: `submit`'s arguments as a dict."""

    prompt: str | None


class ClientCore:
    """What `Client` and `AsyncClient` decide; they make the Redis calls. Its one look at the
    server, when made, finds a Redis Cluster's shards (where the jobs go, and the home shard).

    It names the client's reply stream, checks jobs into requests and splits them into
    pipelined round trips; `chunk_of` and `is_last` say what each reply means, and
    `GenerateResult` sums a request's chunks.
    """

    def __init__(self, redis_url: str | None, config: BusConfig | None) -> None:
        # On a Redis Cluster (the one look at the server): the shard its jobs go to, and
        # the home shard, where batches and files are (runtime/cluster.py).
        self.config, self.home = client_shards(resolve_config(redis_url, config))
        self.reply_stream = self.config.reply_stream(f"client-{uuid.uuid4().hex}")

    def requests(self, jobs: Iterable[JobSpec]) -> list[GenerateRequest]:
        """Every job checked before any is sent, so a ValueError leaves nothing queued."""
        return [new_request(self.reply_stream, **job) for job in jobs]

    @staticmethod
    def round_trips(requests: list[GenerateRequest]) -> Iterator[list[GenerateRequest]]:
        for start in range(0, len(requests), SUBMIT_PIPELINE_SIZE):
            yield requests[start : start + SUBMIT_PIPELINE_SIZE]


def chunk_of(rid: str, message: Reply | None) -> dict[str, Any]:
    """One reply as a chunk dict; None (aborted here) ends with finish_reason "abort"."""
    if message is None:
        return {"rid": rid, "text": "", "output_ids": [], "finish_reason": "abort"}
    failure = message if isinstance(message, ErrorReply) else message.failure()
    if failure is not None:  # an ErrorReply, or a Finish of reason error
        raise RequestError.from_reply(failure)
    chunk: dict[str, Any] = {
        "rid": rid,
        "text": message.text or "",
        "output_ids": message.ids,
        "finish_reason": None,
    }
    if message.logprobs is not None:
        chunk["logprobs"] = message.logprobs
        chunk["top_logprobs"] = message.top_logprobs
    if message.embedding is not None:
        chunk["embedding"] = np.frombuffer(message.embedding, dtype="<f4").tolist()
    finish = message.finish_info()
    if finish is not None:
        chunk.update(finish_reason=finish.reason, matched_stop=finish.matched, usage=finish.usage())
    return chunk


def is_last(message: Reply | None) -> bool:
    return message is None or isinstance(message, ErrorReply) or message.finish is not None


class GenerateResult:
    """The chunks of one request summed into `generate`'s result."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.text: list[str] = []
        self.output_ids: list[int] = []
        self.last: dict[str, Any] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        self.text.append(chunk["text"])
        self.output_ids.extend(chunk["output_ids"])
        self.last = chunk

    def result(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "text": "".join(self.text),
            "output_ids": self.output_ids,
            "finish_reason": self.last.get("finish_reason"),
            "matched_stop": self.last.get("matched_stop"),
            "usage": self.last.get("usage"),
            **({"embedding": self.last["embedding"]} if "embedding" in self.last else {}),
        }


class Client(BatchMethods):
    """Submit jobs to the pipeline and read their replies; thread-safe. Its batch methods
    (`BatchMethods`) store batches that the ingress replicas run."""

    def __init__(self, redis_url: str | None = None, config: BusConfig | None = None) -> None:
        self.core = ClientCore(redis_url, config)
        self.config = self.core.config
        self.reply_stream = self.core.reply_stream
        self.redis = redis.Redis.from_url(
            self.config.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S
        )
        self.replies = ReplyReader(self.redis, self.reply_stream)
        self.home_config = self.core.home
        self.home_redis = self.redis
        if self.home_config is not self.config:
            self.home_redis = redis.Redis.from_url(
                self.home_config.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S
            )

    def submit(self, prompt: str | None = None, **options: Unpack[JobOptions]) -> str:
        """Queue one job; returns its rid. ValueError for a malformed job.

        The job is `prompt` (text), or `messages=` (a chat) or `input_ids=` (token ids); with
        `sampling=` (sampling parameters, as /generate's sampling_params) and `rid=` (default:
        a new uuid). The same keywords as `JobOptions`, for every method that takes a job.
        """
        return self.submit_many([{"prompt": prompt, **options}])[0]

    def submit_many(self, jobs: Iterable[JobSpec]) -> list[str]:
        """Queue many jobs (each a dict of `submit`'s arguments), pipelined; returns their rids.

        Every job is checked before any is sent, so a ValueError leaves nothing queued.
        """
        requests = self.core.requests(jobs)
        for request in requests:
            self.replies.register(request.rid)
            request.tag = self.replies.tag(request.rid)  # its replies' name (bus/reply_tags.py)
        for batch in self.core.round_trips(requests):
            pipe = self.redis.pipeline(transaction=False)
            add_requests(pipe, self.config, batch)
            pipe.execute()
        return [request.rid for request in requests]

    def stream(self, rid: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Chunk dicts ``{rid, text, output_ids, finish_reason, matched_stop?, usage?}``.

        Raises RequestError on an error reply, TimeoutError when no reply comes for
        `timeout` seconds, KeyError for a rid this client is not waiting for.
        """
        while True:
            message = self.replies.get(rid, timeout)
            yield chunk_of(rid, message)
            if is_last(message):
                return

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[JobOptions],
    ) -> dict[str, Any]:
        """Submit and wait: ``{rid, text, output_ids, finish_reason, matched_stop, usage}``."""
        result = GenerateResult(self.submit(prompt, **options))
        for chunk in self.stream(result.rid, timeout):
            result.add(chunk)
        return result.result()

    def abort(self, rid: str) -> None:
        """Stop `rid` wherever it is; its stream ends next, with finish_reason "abort"."""
        self.replies.cancel(rid)
        publish_abort(self.redis, self.config, rid)

    def close(self) -> None:
        self.replies.close()
        self.redis.close()
        if self.home_redis is not self.redis:
            self.home_redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """`Client` for asyncio: the same methods, awaited; `stream` is an async iterator. No
    batch methods: the stores block (run `Client`'s in a thread)."""

    def __init__(self, redis_url: str | None = None, config: BusConfig | None = None) -> None:
        self.core = ClientCore(redis_url, config)
        self.config = self.core.config
        self.reply_stream = self.core.reply_stream
        self.redis = async_redis(self.config.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S)
        self.replies = AsyncReplyReader(self.redis, self.reply_stream)
        self._queues: dict[str, asyncio.Queue[Reply | None]] = {}

    async def submit(self, prompt: str | None = None, **options: Unpack[JobOptions]) -> str:
        return (await self.submit_many([{"prompt": prompt, **options}]))[0]

    async def submit_many(self, jobs: Iterable[JobSpec]) -> list[str]:
        requests = self.core.requests(jobs)
        self.replies.start()
        for request in requests:
            self._queues[request.rid] = self.replies.register(request.rid)
            request.tag = self.replies.tag(request.rid)  # its replies' name (bus/reply_tags.py)
        for batch in self.core.round_trips(requests):
            pipe = self.redis.pipeline(transaction=False)
            add_requests(pipe, self.config, batch)
            await pipe.execute()
        return [request.rid for request in requests]

    async def stream(self, rid: str, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        queue = self._queues.get(rid)
        if queue is None:
            raise KeyError(f"unknown or finished request {rid!r}")
        while True:
            # Not asyncio.wait_for: on Python 3.11 it drops a cancellation that lands with
            # a reply, and the caller's task goes on (runtime/task_cancel.py).
            async with async_timeout(timeout):
                message = await queue.get()
            if is_last(message):
                self._queues.pop(rid, None)
            yield chunk_of(rid, message)
            if is_last(message):
                return

    async def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        **options: Unpack[JobOptions],
    ) -> dict[str, Any]:
        result = GenerateResult(await self.submit(prompt, **options))
        async for chunk in self.stream(result.rid, timeout):
            result.add(chunk)
        return result.result()

    async def abort(self, rid: str) -> None:
        queue = self._queues.get(rid)
        if queue is not None:  # its stream ends next; unread replies are dropped
            self.replies.unregister(rid)
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(None)
        await publish_abort_async(self.redis, self.config, rid)

    async def close(self) -> None:
        await self.replies.close()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
