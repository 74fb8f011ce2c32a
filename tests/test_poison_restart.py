"""`streamserve up` on a data directory that holds poison: jobs that once killed workers,
kept in the embedded server's append-only file. It starts, answers each of them with an
error, restarts no process, and serves.
"""

from __future__ import annotations

import time

import msgpack
import redis

from bus.reconnect import ensure_group
from jobs.protocol import ENTRY_FIELD, ErrorReply, decode, pack_ids
from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis
from tests.test_launcher_stop import _Up
from tests.test_redis_persistence import FSYNC_WINDOW_S, _generate, _socket_path

DEEP = "[" * 100_000
REPLIES = "poison:replies"
ANSWER_TIMEOUT_S = 60.0


def _poison(rid: str, kind: str = "tokenized", **fields) -> bytes:
    job = {"kind": kind, "rid": rid, "reply_to": REPLIES, **fields}
    return msgpack.packb(job, use_bin_type=True)


def _store_poison(client: redis.Redis, config: BusConfig) -> set[str]:
    """Poison on every stream a client writes, and one job a dead worker held; their rids."""
    deep = {"input_ids": pack_ids([1, 2, 3]), "sampling": {"json_schema": DEEP}}
    client.xadd(config.requests_stream(), {ENTRY_FIELD: _poison("p-map", "generate",
                                                                 prompt={"a": 1})})  # fmt: skip
    client.xadd(config.tokenized_stream(), {ENTRY_FIELD: _poison("p-deep", **deep)})
    # A worker that died while it held a job that had already killed two others.
    stream = config.worker_stream("dead-worker")
    ensure_group(client, stream, "worker")
    held = {"input_ids": pack_ids([1, 2, 3]), "sampling": {"max_new_tokens": 4}, "attempts": 2}
    client.xadd(stream, {ENTRY_FIELD: _poison("p-killer", **held)})
    client.xreadgroup("worker", "dead-consumer", {stream: ">"})
    client.sadd(config.workers_key(), "dead-worker")
    client.xadd(stream, {ENTRY_FIELD: _poison("p-deep-routed", **deep)})
    return {"p-map", "p-deep", "p-killer", "p-deep-routed"}


def test_streamserve_up_on_a_data_dir_holding_poison_starts_answers_it_and_serves(tmp_path):
    data = tmp_path / "redis"
    config = BusConfig(redis_url="unix:///unused")
    with EmbeddedRedis(data_dir=data) as server:
        client = redis.Redis.from_url(server.url)
        rids = _store_poison(client, config)
        time.sleep(FSYNC_WINDOW_S)
        client.close()

    up = _Up(data)
    try:
        up.wait_until_up()
        client = redis.Redis.from_url(f"unix://{_socket_path(up)}")
        children = sorted(up.children())
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        answers: dict[str, ErrorReply] = {}
        while set(answers) != rids and time.monotonic() < deadline:
            time.sleep(0.5)
            answers = {
                reply.rid: reply
                for reply in (
                    decode(f[ENTRY_FIELD], ErrorReply) for _, f in client.xrange(REPLIES)
                )  # fmt: skip
            }
        assert set(answers) == rids, up.output[-3000:]
        assert answers["p-killer"].code == "poison_job"
        assert all(answers[rid].status == 400 for rid in rids - {"p-killer"})
        assert _generate(up) == 200
        assert sorted(up.children()) == children  # nothing died and was started again
        assert "started again" not in up.output and "stopping everything" not in up.output
    finally:
        up.kill()
