"""Anyone with Redis access can write anything anywhere, and an append-only file keeps it.
With garbage on every stream, set, hash, sorted set and string key a running system has (and
on the indexes of its batches and background responses), no process of `streamserve up`
ends or restarts, it serves on, and a new `streamserve up` on the same server starts and
serves. Before, one workers-set member that was not UTF-8 crash-looped every detokenizer
until the launcher stopped everything, and did so again at every start.

tests/test_hostile_jobs.py holds the jobs a client can send; this is the bus's own state.
"""

from __future__ import annotations

import json
import time
import urllib.request

import msgpack
import pytest
import redis

from jobs.protocol import MESSAGE_TYPES
from runtime.embedded_server import EmbeddedRedis
from tests.pipeline_harness import Pipeline

pytestmark = pytest.mark.slow

# Bytes no reader can make a message of, and messages of every kind with wrong-typed fields.
PAYLOADS = [
    b"",
    b"\xc1",  # never valid msgpack
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"kind": "nothing"}),
    msgpack.packb({"kind": "tokens", "worker_id": "w", "step": 1, "items": [{"rid": 5}]}),
    msgpack.packb({"kind": "deltas", "deltas": [{"tag": -1, "seq": -1, "n": -1}, 7]}),
    b"\x91" * 5000 + b"\x00",  # nested 5,000 deep
    *(msgpack.packb({"kind": kind, "rid": ["x"], "reply_to": 5, "items": "no", "ids": {}})
      for kind in sorted(MESSAGE_TYPES)),
]  # fmt: skip
# Members no worker, batch or response could be named by.
BAD_MEMBERS = [b"\xff\xfe", b"a:b", b"", b" w"]


def _serves(pipeline: Pipeline) -> None:
    """A completion answered whole, and one streamed to its end."""
    body = {"model": pipeline.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    status, answer = pipeline.post("/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    request = urllib.request.Request(
        pipeline.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200 and reply.read().rstrip().endswith(b"data: [DONE]")


def _spoil(client: redis.Redis, prefix: str) -> None:
    """Garbage on every key the system made, by its type, and in the indexes it reads."""
    for key in list(client.scan_iter(match=f"{prefix}:*", count=1000)):
        kind = client.type(key)
        if kind == b"stream":
            for payload in PAYLOADS:
                client.xadd(key, {b"m": payload, b"t": payload, b"rids": payload})
        elif kind == b"set":
            client.sadd(key, *BAD_MEMBERS)
        elif kind == b"hash":
            client.hset(key, mapping={b"\xff": b"\xff", "a:b": "x", "w9": "1e400"})
        elif kind == b"zset":
            client.zadd(key, dict.fromkeys(BAD_MEMBERS, time.time()))
        elif kind == b"string":
            client.set(key, PAYLOADS[1], keepttl=True)
    for index in ("batches:active", "responses:background"):
        client.sadd(f"{prefix}:{index}", *BAD_MEMBERS, "nothing-here")


def test_garbage_on_every_key_and_stream_ends_no_process_and_a_new_start_serves(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        with Pipeline(redis_url=server.url) as pipeline:
            _serves(pipeline)  # so its streams and keys exist
            replicas = {name: pipeline.replica_pids(name) for name in ("gpu_worker", "stage")}
            _spoil(client, pipeline.config.key_prefix)
            time.sleep(2.5)  # the keepers' and reaper's passes (a second); the detokenizer
            # names its inputs again at once when its own stream brings something
            _serves(pipeline)
            assert {name: pipeline.replica_pids(name) for name in replicas} == replicas
            assert pipeline.process is not None and pipeline.process.poll() is None
        with Pipeline(redis_url=server.url) as again:  # the garbage is still there
            time.sleep(2)  # the keepers' and the reaper's passes (each a second)
            _serves(again)
            assert again.process is not None and again.process.poll() is None
