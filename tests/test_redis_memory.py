"""Redis's memory is bounded and full means "later", never "lost": the embedded server runs
with maxmemory and noeviction; when it is full the ingress answers 503 with Retry-After, a
stage whose MULTI is refused leaves its inputs pending, and all of it is served once memory
is freed."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis

from bus.actor import Actor
from bus.effects import Outbound, write_outputs
from bus.fenced_stream import WORKER_GROUP
from bus.reconnect import ensure_group
from bus.stream_trim import trim_acknowledged
from jobs.protocol import ENTRY_FIELD, TokenizedRequest, decode
from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis
from stages.router.stage import RouterStage
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
BALLAST_BYTES = 2**20
BALLAST_KEYS = 8  # freeing them leaves 7 MiB of room


def test_the_embedded_server_bounds_its_memory_and_never_evicts(redis_client):
    settings = redis_client.config_get("maxmemory*")
    assert int(settings["maxmemory"]) == 2**30  # BusConfig.redis_maxmemory's 1gb
    assert settings["maxmemory-policy"] == "noeviction"


def test_the_maxmemory_setting_reaches_the_embedded_server():
    assert BusConfig.from_env({"STREAMSERVE_REDIS_MAXMEMORY": "64mb"}).redis_maxmemory == "64mb"
    with pytest.raises(ValueError, match="STREAMSERVE_REDIS_MAXMEMORY"):
        BusConfig.from_env({"STREAMSERVE_REDIS_MAXMEMORY": "0"})
    with EmbeddedRedis(maxmemory="64mb") as server:
        client = redis.Redis.from_url(server.url)
        assert int(client.config_get("maxmemory")["maxmemory"]) == 64 * 2**20
        client.close()


def fill(client: redis.Redis) -> None:
    """Take Redis past its maxmemory: ballast keys, then a limit just below what it uses."""
    for i in range(BALLAST_KEYS):
        client.set(f"ballast:{i}", b"x" * BALLAST_BYTES)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used - BALLAST_BYTES)
    with pytest.raises(redis.OutOfMemoryError):
        client.set("probe", 1)


def free(client: redis.Redis) -> None:
    client.delete(*client.keys("ballast:*"))  # DEL is allowed while full: memory comes back
    client.set("probe", 1)


@pytest.fixture
def private_server():
    """A server of the test's own: it is filled, and must not fill the session's."""
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        yield server.url, client
        client.close()


def test_a_full_redis_is_503_with_retry_after_and_serves_again_once_freed(private_server):
    url, client = private_server
    with RunningIngress(url) as ingress:
        add_worker(client, ingress.config)
        with Upstream(url, ingress.config, lambda r: deltas(r.rid, [("ok", [1])])):
            assert ingress.post(CHAT, BODY)[0] == 200
            fill(client)
            status, headers, data = ingress.request("POST", CHAT, BODY)
            error = json.loads(data)["error"]
            assert status == 503 and error["code"] == "redis_full", data
            assert error["type"] == "service_unavailable"
            assert int(headers["Retry-After"]) >= 1
            assert client.xlen(ingress.config.requests_stream()) == 1  # nothing half-queued
            free(client)
            status, reply = ingress.post(CHAT, BODY)
    assert status == 200 and reply["choices"][0]["message"]["content"] == "ok"


def test_jobs_accepted_before_redis_filled_are_all_routed_once_it_is_freed(private_server):
    """The router's MULTI is refused while Redis is full: its jobs stay pending (not acked,
    not dead-lettered, the stage alive), and every one is routed once memory is freed."""
    url, client = private_server
    config = BusConfig(redis_url=url, claim_idle_ms=300, block_ms=50)
    add_worker(client, config)
    ensure_group(client, config.tokenized_stream(), "router")  # the router ran before
    rids = [f"r{i}" for i in range(20)]
    pipe = client.pipeline(transaction=True)
    write_outputs(pipe, config, [
        Outbound(config.tokenized_stream(), TokenizedRequest(rid, "t:reply", [1, 2], {}))
        for rid in rids
    ])  # fmt: skip
    pipe.execute()
    fill(client)
    stop = threading.Event()
    router = Actor(client, config, RouterStage(config, client, stop), stop)
    thread = threading.Thread(target=router.run, daemon=True)
    thread.start()
    try:
        time.sleep(3.0)  # turns refused with OOM, retried: ten times claim_idle_ms
        assert thread.is_alive()
        # Retried by the replica that holds them, not claimed: no delivery is counted, so
        # a full Redis never makes a job look like poison (max_deliveries).
        held = client.xpending_range(config.tokenized_stream(), "router", "-", "+", 100)
        assert {p["times_delivered"] for p in held} == {1}
        assert client.xlen(config.worker_stream("w0")) == 0
        pending = client.xpending(config.tokenized_stream(), "router")["pending"]
        assert pending == 1  # the one bundle entry holding every job
        free(client)
        routed = _wait_for_routed(client, config, len(rids))
    finally:
        stop.set()
        thread.join(timeout=5)
    assert sorted(routed) == sorted(rids)
    assert client.xlen(config.dead_letter_stream()) == 0
    assert client.xpending(config.tokenized_stream(), "router")["pending"] == 0


def _wait_for_routed(client: redis.Redis, config: BusConfig, count: int) -> list[str]:
    deadline = time.monotonic() + 10
    while True:
        entries = client.xrange(config.worker_stream("w0"))
        if len(entries) >= count or time.monotonic() > deadline:
            return [decode(fields[ENTRY_FIELD], TokenizedRequest).rid for _, fields in entries]
        time.sleep(0.05)


def test_a_worker_stream_keeps_a_job_until_the_worker_acknowledges_it(private_server):
    """What the worker's periodic trim (bus/fenced_stream.py) relies on: a worker's group
    exists on its stream, so its unacknowledged jobs hold the trim back."""
    url, client = private_server
    config = BusConfig(redis_url=url)
    stream = config.worker_stream("w0")
    client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
    first = client.xadd(stream, {ENTRY_FIELD: b"job"})
    client.xreadgroup(WORKER_GROUP, "w", {stream: ">"})
    assert trim_acknowledged(client, stream) == 0
    client.xack(stream, WORKER_GROUP, first)
    assert trim_acknowledged(client, stream) == 1
