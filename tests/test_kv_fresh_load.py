"""A worker's load on its kv-events entries: the router sees a finished job leave a worker
before the worker's next heartbeat, and keeps whichever of the two figures is newer.

On a real server: the worker-side tests run a real Worker (a small random model) whose
heartbeat is made too slow to beat during the test; the router's use the real stage, with
other workers as keys (a heartbeat and the set)."""

from __future__ import annotations

import time

import msgpack
import pytest
import redis

from jobs.kv_blocks import block_hashes
from jobs.kv_events import KvEvents, LoadReading
from jobs.protocol import ENTRY_FIELD, Heartbeat, ProtocolError, TokenizedRequest, decode, encode
from runtime.config import BusConfig
from stages.router.kv_index import KvIndex
from stages.router.stage import live_workers
from tests.test_kv_routing import (
    BLOCK,
    GREEDY,
    MODEL,
    SYSTEM,
    _events,
    _finished,
    _finishes,
    _job,
    _routed,
    _router,
)
from tests.test_worker_migration import _start, _wait


@pytest.fixture
def config(redis_url) -> BusConfig:
    # No heartbeat but the worker's first within a test: its load is as old as it gets.
    return BusConfig(redis_url=redis_url, block_ms=20, heartbeat_interval_s=60,
                     heartbeat_ttl_s=120, publish_interval_ms=20, no_worker_timeout_s=0.5,
                     kv_block_tokens=BLOCK)  # fmt: skip


def _beat(client: redis.Redis, config: BusConfig, worker_id: str, at: float, running: int = 0,
          admitted: int = 0) -> None:  # fmt: skip
    beat = Heartbeat(worker_id, config.worker_stream(worker_id), MODEL, running, 0, 10_000,
                     20_000, admitted, at)  # fmt: skip
    client.set(config.heartbeat_key(worker_id), encode(beat), px=5_000)
    client.sadd(config.workers_key(), worker_id)


def _write(client: redis.Redis, config: BusConfig, events: KvEvents, **wire: object) -> None:
    """Add `events` to the stream, with its wire fields replaced by `wire` (None: removed)."""
    data = msgpack.unpackb(encode(events), raw=False)
    for name, value in wire.items():
        data.pop(name) if value is None else data.__setitem__(name, value)
    client.xadd(config.kv_events_stream(), {ENTRY_FIELD: msgpack.packb(data)})


def _loaded(worker_id: str, running: int, admitted: int, at: float) -> KvEvents:
    return KvEvents(worker_id, running=running, waiting=0, free_kv_tokens=10_000,
                    admitted=admitted, time=at)  # fmt: skip


def _queued(client: redis.Redis, config: BusConfig, index: KvIndex) -> dict[str, int]:
    index.refresh()
    return {w.worker_id: w.queued for w in live_workers(client, config, index.loads)}


# ---- the entry ---------------------------------------------------------------------------------


def test_the_load_travels_on_the_entry_and_an_entry_without_one_still_decodes():
    events = _loaded("w", running=2, admitted=7, at=1234.5)
    assert decode(encode(events), KvEvents).load == LoadReading(2, 0, 10_000, 7, 1234.5)
    old = msgpack.packb({"kind": "kv", "worker_id": "w", "stored": [1], "removed": []})
    assert decode(old, KvEvents) == KvEvents("w", [1]) and decode(old, KvEvents).load is None


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        ({"running": -1}, "'running' must not be negative"),
        ({"admitted": "3"}, "'admitted' must be int"),
        ({"waiting": True}, "'waiting' must be int"),
        ({"time": None}, "'time' is missing from the load"),
        ({"free_kv_tokens": None}, "'free_kv_tokens' is missing from the load"),
        ({"time": float("nan")}, "'time' must be finite"),
    ],
)
def test_a_malformed_load_is_skipped_like_any_malformed_entry(redis_client, config, wire, reason):
    _write(redis_client, config, _loaded("w", running=4, admitted=1, at=time.time()), **wire)
    with pytest.raises(ProtocolError, match=reason):
        decode(redis_client.xrange(config.kv_events_stream())[0][1][ENTRY_FIELD], KvEvents)
    _write(redis_client, config, KvEvents("w", block_hashes(SYSTEM, BLOCK)))
    index = KvIndex(redis_client, config)
    assert index.refresh() == 2  # the bad one skipped, the next one applied
    assert index.loads == {} and index.cached_blocks(block_hashes(SYSTEM, BLOCK), "w") == 8


# ---- the router's figure -----------------------------------------------------------------------


def test_the_newer_of_heartbeat_and_kv_events_load_counts_and_an_older_never_overrides(
    redis_client, config
):
    now = time.time()
    _beat(redis_client, config, "w", now, running=1, admitted=3)
    redis_client.hset(config.routed_key(), "w", 5)
    index = KvIndex(redis_client, config)
    assert _queued(redis_client, config, index) == {"w": 1 + 2}  # two in transit
    # Read all five since: its turn ended. In transit: past the figure's own admitted count.
    _write(redis_client, config, _loaded("w", running=0, admitted=5, at=now + 1))
    assert _queued(redis_client, config, index) == {"w": 0}
    _write(redis_client, config, _loaded("w", running=4, admitted=5, at=now + 0.5))  # older
    assert _queued(redis_client, config, index) == {"w": 0}
    assert index.loads["w"].time == now + 1
    _beat(redis_client, config, "w", now + 2, running=2, admitted=5)  # a newer heartbeat
    assert _queued(redis_client, config, index) == {"w": 2}
    # An entry of an older worker, without a load, leaves the newest figure as it was.
    redis_client.xadd(config.kv_events_stream(), {ENTRY_FIELD: encode(KvEvents("w", [1]))})
    assert _queued(redis_client, config, index) == {"w": 2} and index.loads["w"].time == now + 1


def test_a_lapsed_workers_load_goes_with_its_index_entries(redis_client, config):
    _write(redis_client, config, _loaded("gone", running=0, admitted=0, at=time.time()))
    index = KvIndex(redis_client, config)
    index.refresh()
    assert "gone" in index.loads
    index.keep_only(["w"])
    assert index.loads == {} and "gone" not in index.by_worker


# ---- a real worker -----------------------------------------------------------------------------


def _started(client: redis.Redis, config: BusConfig, worker_id: str):
    worker, thread = _start(client, config, worker_id)
    _wait(lambda: client.exists(config.heartbeat_key(worker_id)))
    return worker, thread


def test_a_finished_job_lowers_the_workers_load_before_its_next_heartbeat(redis_client, config):
    worker, thread = _started(redis_client, config, "w")
    index = KvIndex(redis_client, config)
    try:
        prompt = SYSTEM + [5, 6]
        for rid in ("r1", "r2"):  # the same prompt again: its finish stores nothing new
            redis_client.hincrby(config.routed_key(), "w", 1)  # as the router does
            job = TokenizedRequest(rid, "t:reply", prompt, {**GREEDY, "max_new_tokens": 4})
            redis_client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})
            _wait(lambda rid=rid: rid in _finished(redis_client, config))
            _wait(lambda: _queued(redis_client, config, index) == {"w": 0})
        beat = decode(redis_client.get(config.heartbeat_key("w")), Heartbeat)
        assert (beat.admitted, beat.running) == (0, 0)  # its only beat: both jobs in transit
        assert {w.worker_id: w.queued for w in live_workers(redis_client, config)} == {"w": 2}
        load = index.loads["w"]
        assert (load.running, load.waiting, load.admitted) == (0, 0, 2) and load.time > beat.time
        last = _events(redis_client, config)[-1]  # r2's finish: the load alone
        assert (last.stored, last.removed, last.snapshot) == ([], [], False)
        assert last.load == load
    finally:
        worker.stop.set()
        thread.join(timeout=30)


def test_a_conversations_next_turn_sticks_to_the_holder_right_after_its_turn_finished(
    redis_client, config
):
    # No hot-prefix slack: a holder one job busier than an idle worker would lose the turn.
    config = BusConfig.from_env({}, **{**vars(config), "kv_balance_jobs": 0})
    worker, thread = _started(redis_client, config, "w1")
    try:
        actor, _ = _router(redis_client, config)
        turn = SYSTEM + [5, 6, 7, 8]
        _job(redis_client, config, "t1", turn, {**GREEDY, "max_new_tokens": 4})
        actor.run_once()
        _wait(lambda: "t1" in _finished(redis_client, config))
        # An idle worker with the most free KV, beating now: newer than w1's only heartbeat.
        _beat(redis_client, config, "w2", time.time())
        turn += _finished(redis_client, config)["t1"] + [9, 10]
        _job(redis_client, config, "t2", turn, {**GREEDY, "max_new_tokens": 4})
        actor.run_once()
        assert _routed(redis_client, config, "w1") == ["t1", "t2"]
        assert _routed(redis_client, config, "w2") == []
        _wait(lambda: "t2" in _finished(redis_client, config))
        assert _finishes(redis_client, config)["t2"].route_reason == "prefix"
    finally:
        worker.stop.set()
        thread.join(timeout=30)
