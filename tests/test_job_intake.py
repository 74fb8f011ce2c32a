"""A worker reads new jobs with a thread of its own (gpu_worker/job_intake.py): a command
per arrival, not one in every commit; nothing read twice after a fence; the group made
again when Redis lost it. Synthetic and random-model workers on a real server."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from bus.fenced_stream import WORKER_GROUP, FencedStream
from gpu_worker.job_intake import JobIntake
from gpu_worker.synthetic_engine import SyntheticEngine
from gpu_worker.worker import Worker
from jobs.protocol import ENTRY_FIELD, TokenBatch, TokenizedRequest, decode, encode
from runtime.config import BusConfig
from tests.worker_thread import published_entries, running, wait_until

MODEL = "smollm2-135m-instruct"


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=300, publish_interval_ms=20,
                     heartbeat_interval_s=0.2)  # fmt: skip


@pytest.fixture
def worker(redis_client, config):
    engine = SyntheticEngine(MODEL, step_ms=5.0, batch=8)
    with running(Worker(engine, redis_client, config, "w", MODEL), redis_client, config) as w:
        yield w


def _route(client: redis.Redis, config: BusConfig, rid: str, max_new: int) -> None:
    job = TokenizedRequest(rid, "t:reply", [5, 17, 99], {"max_new_tokens": max_new,
                                                         "ignore_eos": True})  # fmt: skip
    client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})


def _published(client: redis.Redis, config: BusConfig) -> dict[str, tuple[int, bool]]:
    """rid -> (output ids published, finished)."""
    out: dict[str, tuple[int, bool]] = {}
    for _, fields in published_entries(client, config):
        for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
            out[item.rid] = (item.start + len(item.ids), item.finish is not None)
    return out


def _calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}


def test_a_busy_worker_reads_per_arrival_not_per_publish(redis_client, config, worker):
    redis_client.config_resetstat()
    started = time.monotonic()
    _route(redis_client, config, "long", 300)  # ~1.5 s of 5 ms steps
    wait_until(lambda: _published(redis_client, config).get("long", (0, False))[0] > 20)
    _route(redis_client, config, "late", 10)  # arrives while the worker is busy
    waited = wait_until(lambda: _published(redis_client, config).get("late", (0, False))[1])
    assert waited < 1.0  # read at once, not after the long job
    wait_until(lambda: _published(redis_client, config).get("long", (0, False))[1])
    seconds = time.monotonic() - started
    calls = _calls(redis_client)
    assert _published(redis_client, config) == {"long": (300, True), "late": (10, True)}
    # A publish each ~20 ms: its log entry's XADD (in a script, or alone: bus/fenced_stream.py).
    assert calls["xadd"] >= 30
    # Each arrival (2), and a blocking read's end once per block_ms while none came.
    bound = 2 + seconds / (config.block_ms / 1000) + 2
    assert calls["xreadgroup"] <= bound, (calls["xreadgroup"], bound, calls["xadd"])


def test_the_intake_makes_the_group_again_when_redis_lost_it(redis_client, config, worker):
    redis_client.xgroup_destroy(config.worker_stream("w"), WORKER_GROUP)
    _route(redis_client, config, "after", 5)  # onto a stream with no group: read from id 0
    wait_until(lambda: _published(redis_client, config).get("after", (0, False))[1])
    assert _published(redis_client, config)["after"] == (5, True)


def test_what_the_thread_read_is_dropped_when_the_pending_list_is_read_whole(redis_client, config):
    bus = FencedStream(redis_client, config, "i")
    bus.ensure_group()
    stop = threading.Event()
    intake = JobIntake(bus, stop)
    intake.start()
    try:
        for rid in ("a", "b"):
            _route_to(redis_client, bus.stream, rid)
        wait_until(lambda: redis_client.xpending(bus.stream, WORKER_GROUP)["pending"] == 2)
        with intake.paused():  # as after a fence: the pending list, read whole
            pending = bus.pending_entries()
        assert len(pending) == 2
        assert intake.take() == []  # not also handed over by the thread
        _route_to(redis_client, bus.stream, "c")
        (entry,) = intake.take(wait_s=5)
        assert decode(entry[1][ENTRY_FIELD], TokenizedRequest).rid == "c"
    finally:
        stop.set()


def _route_to(client: redis.Redis, stream: str, rid: str) -> None:
    job = TokenizedRequest(rid, "t:reply", [1, 2], {"max_new_tokens": 1})
    client.xadd(stream, {ENTRY_FIELD: encode(job)})


def test_jobs_arriving_faster_than_the_publishes_are_read_together(redis_client, config, worker):
    _route(redis_client, config, "long", 300)  # busy for ~1.5 s
    wait_until(lambda: _published(redis_client, config).get("long", (0, False))[0] > 5)
    redis_client.config_resetstat()
    started = time.monotonic()
    for i in range(40):  # one every ~2 ms, ten times the publishes' pace
        _route(redis_client, config, f"r{i}", 2)
        time.sleep(0.002)
    wait_until(lambda: all(_published(redis_client, config).get(f"r{i}", (0, False))[1]
                           for i in range(40)))  # fmt: skip
    seconds = time.monotonic() - started
    calls = _calls(redis_client)
    # At most a read per publish interval, and a blocking read's end per block_ms after.
    bound = seconds / (config.publish_interval_ms / 1000) + seconds / (config.block_ms / 1000) + 2
    assert calls["xreadgroup"] <= min(bound, 25), (calls["xreadgroup"], bound)  # not per job
    assert calls.get("mget", 0) <= calls["xreadgroup"]  # the flags of each read's jobs at once
