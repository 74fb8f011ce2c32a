"""The one reader of which workers are alive (bus/liveness.py), on the real embedded server:
its blocking and asyncio forms give the same answer, in the same two commands."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aredis

from bus.liveness import Liveness, RegisteredWorkers, read_liveness, read_liveness_async
from jobs.protocol import Heartbeat, encode
from runtime.config import BusConfig


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url)


def _beat(worker_id: str, config: BusConfig, attention: str | None = None) -> Heartbeat:
    return Heartbeat(worker_id, config.worker_stream(worker_id), "random:tiny", 1, 2, 300,
                     400, 5, time.time(), attention)  # fmt: skip


def _register(client: redis.Redis, config: BusConfig, worker_id: str, value: bytes | None):
    client.sadd(config.workers_key(), worker_id)
    if value is not None:
        client.set(config.heartbeat_key(worker_id), value, px=60_000)


def _both(redis_url: str, config: BusConfig, routed: bool = False) -> tuple[Liveness, Liveness]:
    """The blocking read and the asyncio read, one after the other."""
    client = redis.Redis.from_url(redis_url)

    async def read_async() -> Liveness:
        aclient = aredis.Redis.from_url(redis_url)
        try:
            return await read_liveness_async(aclient, config, routed)
        finally:
            await aclient.aclose()

    try:
        return read_liveness(client, config, routed), asyncio.run(read_async())
    finally:
        client.close()


def _commands(client: redis.Redis, read) -> dict[str, int]:
    """The commands the server ran for `read()`, by name; those of counting them and of a new
    connection's handshake (CLIENT SETINFO, HELLO) left out."""
    client.config_resetstat()
    read()
    calls = {
        name.removeprefix("cmdstat_"): stat["calls"]
        for name, stat in client.info("commandstats").items()
    }
    return {
        name: n for name, n in calls.items()
        if name.split("|")[0] not in ("config", "info", "client", "hello")
    }  # fmt: skip


def test_alive_lapsed_and_malformed_workers_read_alike_by_both_forms(
    redis_client, redis_url, config
):
    sound = _beat("w1", config, attention="flashinfer")
    _register(redis_client, config, "w1", encode(sound))
    _register(redis_client, config, "w2", b"\xc1")  # not msgpack: alive, but unreadable
    _register(redis_client, config, "w3", None)  # its key expired: lapsed
    _register(redis_client, config, "w0", encode(_beat("w0", config)))
    redis_client.hset(config.routed_key(), mapping={"w1": 7, "w3": 2})
    sync, from_async = _both(redis_url, config, routed=True)
    assert sync == from_async
    assert sync.registered == ("w0", "w1", "w2", "w3")
    assert list(sync.beats) == ["w0", "w1"] and sync.beats["w1"] == sound
    assert list(sync.malformed) == ["w2"]
    assert sync.alive == ("w0", "w1", "w2")
    assert sync.lapsed == {"w3"}
    assert sync.routed == {"w1": 7, "w3": 2}
    assert read_liveness(redis_client, config).routed == {}  # only when asked


def test_members_and_counts_no_worker_wrote_are_left_out_not_raised(
    redis_client, redis_url, config
):
    # Anyone can write to Redis: a member that names no key (not UTF-8, empty, a ':' or a
    # space) and a routed count that is no integer were each a crash of every reader.
    _register(redis_client, config, "w1", encode(_beat("w1", config)))
    redis_client.sadd(config.workers_key(), b"\xff\xfe", b"", b"a:b", b" w", b"w 2")
    redis_client.hset(config.routed_key(), mapping={"w1": 3, b"\xff": 1, "w2": "x", "w3": "1.5"})
    sync, from_async = _both(redis_url, config, routed=True)
    assert sync == from_async
    assert sync.registered == sync.alive == ("w1",)
    assert sync.routed == {"w1": 3}
    kept = RegisteredWorkers()
    assert read_liveness(redis_client, config, registered=kept).registered == ("w1",)


def test_no_registered_worker_reads_as_empty(redis_client, redis_url, config):
    redis_client.set(config.heartbeat_key("stray"), encode(_beat("stray", config)))
    assert _both(redis_url, config, routed=True) == (Liveness(), Liveness())


@pytest.mark.parametrize("routed", [False, True])
def test_a_read_is_one_smembers_and_one_mget_and_the_routed_hash_when_asked(
    redis_client, redis_url, config, routed
):
    for worker_id in ("w1", "w2", "w3"):
        _register(redis_client, config, worker_id, encode(_beat(worker_id, config)))
    expected = {"smembers": 1, "mget": 1, **({"hgetall": 1} if routed else {})}
    assert _commands(redis_client, lambda: read_liveness(redis_client, config, routed)) == (
        expected
    )
    aclient = aredis.Redis.from_url(redis_url)

    async def read_async() -> None:
        try:
            await read_liveness_async(aclient, config, routed)
        finally:
            await aclient.aclose()

    assert _commands(redis_client, lambda: asyncio.run(read_async())) == expected


def test_with_no_registered_worker_a_read_is_one_smembers(redis_client, config):
    assert _commands(redis_client, lambda: read_liveness(redis_client, config, True)) == {
        "smembers": 1
    }


def test_a_kept_workers_set_is_read_again_once_old_or_when_none_of_it_is_alive(
    redis_client, config
):
    """The router's reads (RegisteredWorkers): the MGET every time, the SMEMBERS once a
    `max_age_s`; a worker started beside live ones is seen then, one started when none of the
    kept ones is alive at once."""
    registered = RegisteredWorkers(max_age_s=0.3)

    def read() -> Liveness:
        return read_liveness(redis_client, config, True, registered)

    assert _commands(redis_client, read) == {"smembers": 1}  # nothing kept while empty
    _register(redis_client, config, "w1", encode(_beat("w1", config)))
    assert _commands(redis_client, read) == {"smembers": 1, "mget": 1, "hgetall": 1}
    assert _commands(redis_client, read) == {"mget": 1, "hgetall": 1}
    _register(redis_client, config, "w2", encode(_beat("w2", config)))
    assert read().alive == ("w1",)  # kept: w2 not seen yet
    time.sleep(0.35)
    assert read().alive == ("w1", "w2")
    redis_client.delete(config.heartbeat_key("w1"), config.heartbeat_key("w2"))  # both lapse
    _register(redis_client, config, "w3", encode(_beat("w3", config)))
    assert read().alive == ("w3",)  # none kept alive: the set read again at once
    assert read().lapsed == {"w1", "w2"}
