"""The reaper moves a dead worker's jobs back to the router, once, on a real server.

A worker here is its keys: a stream with the workers' consumer group (jobs a worker read but
did not finish are pending there, jobs it never read are unread), membership of the workers
set, and a heartbeat key while it lives.
"""

from __future__ import annotations

import threading

import pytest
import redis

from jobs.protocol import ENTRY_FIELD, Abort, TokenizedRequest, decode, encode, job_payloads
from runtime.config import BusConfig
from stages.router.worker_reaper import WORKER_GROUP, WorkerReaper, dead_worker_ids


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url)


def _reaper(client: redis.Redis, config: BusConfig, name: str = "router-a") -> WorkerReaper:
    return WorkerReaper(client, config, name, threading.Event())


def _worker(client: redis.Redis, config: BusConfig, worker_id: str, *, group: bool = True):
    client.sadd(config.workers_key(), worker_id)
    client.hset(config.routed_key(), worker_id, 3)
    if group:
        client.xgroup_create(config.worker_stream(worker_id), WORKER_GROUP, id="0", mkstream=True)


def _route(client: redis.Redis, config: BusConfig, worker_id: str, *rids: str) -> None:
    for rid in rids:
        job = TokenizedRequest(rid, "t:reply", [1, 2, 3], {"max_new_tokens": 4})
        client.xadd(config.worker_stream(worker_id), {ENTRY_FIELD: encode(job)})


def _read(client: redis.Redis, config: BusConfig, worker_id: str, count: int) -> None:
    """The worker reads `count` jobs and, like a worker, leaves them pending until done."""
    client.xreadgroup(WORKER_GROUP, "w-consumer", {config.worker_stream(worker_id): ">"},
                      count=count)  # fmt: skip


def _requeued(client: redis.Redis, config: BusConfig) -> list[str]:
    return [
        decode(payload, TokenizedRequest).rid
        for _, fields in client.xrange(config.tokenized_stream())
        for payload in job_payloads(fields)
    ]


def test_a_dead_workers_pending_and_unread_jobs_go_back_to_the_router_once(redis_client, config):
    _worker(redis_client, config, "w1")
    _route(redis_client, config, "w1", "r1", "r2", "r3")
    _read(redis_client, config, "w1", 2)  # r1, r2 admitted; r3 never read
    assert dead_worker_ids(redis_client, config) == {"w1"}
    assert _reaper(redis_client, config).reap("w1")
    assert sorted(_requeued(redis_client, config)) == ["r1", "r2", "r3"]
    assert not redis_client.exists(config.worker_stream("w1"))
    assert redis_client.smembers(config.workers_key()) == set()
    assert redis_client.hget(config.routed_key(), "w1") is None
    assert not redis_client.exists(config.reaping_key("w1"))
    _reaper(redis_client, config, "router-b").reap("w1")  # a second replica, too late
    assert sorted(_requeued(redis_client, config)) == ["r1", "r2", "r3"]  # nothing twice


def test_a_worker_is_reaped_only_when_seen_dead_on_two_ticks(redis_client, config):
    _worker(redis_client, config, "w1")
    _route(redis_client, config, "w1", "r1")
    reaper = _reaper(redis_client, config)
    reaper.tick()
    assert _requeued(redis_client, config) == []  # a router may still be routing to it
    reaper.tick()
    assert _requeued(redis_client, config) == ["r1"]
    assert reaper.moved == 1


def test_a_beating_worker_is_left_alone(redis_client, config):
    _worker(redis_client, config, "w1")
    _route(redis_client, config, "w1", "r1")
    redis_client.set(config.heartbeat_key("w1"), b"beat", px=5_000)
    reaper = _reaper(redis_client, config)
    reaper.tick()
    reaper.tick()
    assert dead_worker_ids(redis_client, config) == set()
    assert _requeued(redis_client, config) == []
    assert redis_client.xlen(config.worker_stream("w1")) == 1


def test_another_replica_holding_the_lock_keeps_this_one_out(redis_client, config):
    _worker(redis_client, config, "w1")
    _route(redis_client, config, "w1", "r1")
    redis_client.set(config.reaping_key("w1"), "router-b", ex=30)
    assert not _reaper(redis_client, config).reap("w1")
    assert _requeued(redis_client, config) == []


def test_jobs_routed_before_the_worker_made_its_group_are_moved(redis_client, config):
    _worker(redis_client, config, "w1", group=False)
    _route(redis_client, config, "w1", "r1", "r2")
    assert _reaper(redis_client, config).reap("w1")
    assert _requeued(redis_client, config) == ["r1", "r2"]


def test_aborts_are_dropped_and_malformed_entries_dead_lettered(redis_client, config):
    _worker(redis_client, config, "w1")
    stream = config.worker_stream("w1")
    redis_client.xadd(stream, {ENTRY_FIELD: encode(Abort("r0"))})
    redis_client.xadd(stream, {ENTRY_FIELD: b"\xc1 not msgpack"})
    _route(redis_client, config, "w1", "r1")
    assert _reaper(redis_client, config).reap("w1")
    assert _requeued(redis_client, config) == ["r1"]
    ((_, fields),) = redis_client.xrange(config.dead_letter_stream())
    assert fields[b"source"] == stream.encode()
    assert b"not msgpack" in fields[b"reason"]


def test_the_stream_is_kept_when_a_job_lands_after_the_last_pass(redis_client, config):
    """`_forget` is guarded: an entry nobody read keeps the worker's stream and id."""
    _worker(redis_client, config, "w1")
    reaper = _reaper(redis_client, config)
    _route(redis_client, config, "w1", "late")
    assert not reaper._forget("w1", config.worker_stream("w1"))
    assert redis_client.sismember(config.workers_key(), "w1")
    assert reaper.reap("w1")
    assert _requeued(redis_client, config) == ["late"]
