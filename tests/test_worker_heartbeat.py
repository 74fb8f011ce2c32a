"""The worker's heartbeat thread on a real server: it beats through a long step, gives up
on a hung loop, and notices when the reaper took its worker for dead."""

from __future__ import annotations

import threading
import time

import pytest

from gpu_worker.heartbeat import HeartbeatThread, Load
from jobs.protocol import Heartbeat, decode
from runtime.config import BusConfig


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(
        redis_url=redis_url, heartbeat_interval_s=0.05, heartbeat_ttl_s=0.2, worker_stall_s=1.0
    )


def _thread(client, config, on_stall=None) -> HeartbeatThread:
    return HeartbeatThread(
        client, config, "w1", config.worker_stream("w1"), "m", 1000, on_stall,
        attention="flashinfer (self-check passed), CUDA graphs",
    )  # fmt: skip


def test_it_beats_with_the_last_reported_load_while_the_loop_is_busy(redis_client, config):
    heartbeat = _thread(redis_client, config)
    heartbeat.report(Load(running=3, waiting=2, free_kv_tokens=500, admitted=7))
    heartbeat.start()
    try:
        time.sleep(0.6)  # three TTLs without a report: one long engine step
        beat = decode(redis_client.get(config.heartbeat_key("w1")), Heartbeat)
        assert (beat.running, beat.waiting, beat.free_kv_tokens, beat.admitted) == (3, 2, 500, 7)
        assert beat.attention == "flashinfer (self-check passed), CUDA graphs"  # for /health
        assert redis_client.sismember(config.workers_key(), "w1")
    finally:
        heartbeat.goodbye()
    assert redis_client.get(config.heartbeat_key("w1")) is None


def test_a_loop_that_stops_turning_stops_the_heartbeat(redis_client, config):
    stalled = threading.Event()
    heartbeat = _thread(redis_client, config, on_stall=stalled.set)
    heartbeat.start()
    assert stalled.wait(3)  # worker_stall_s is 1 s
    heartbeat.join(1)
    assert not heartbeat.is_alive()
    time.sleep(0.3)
    assert redis_client.get(config.heartbeat_key("w1")) is None  # expired: taken for dead


def test_a_live_worker_removed_from_the_workers_set_registers_again(redis_client, config):
    heartbeat = _thread(redis_client, config)
    heartbeat.beat()
    redis_client.srem(config.workers_key(), "w1")  # what the reaper does
    heartbeat.beat()
    assert redis_client.sismember(config.workers_key(), "w1")
