"""The request keys of one ingress turn (stages/ingress/request_writes.py): one MSETEX with
their expiry where the server has it, SETs where it has not, and a server that loses it
between two turns (swapped for an older one) costs no request."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aredis

from jobs.protocol import GenerateRequest
from jobs.request_normaliser import ModelLimits
from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis
from stages.ingress.request_writes import RequestWrites

REPLY = "t:reply"


def _turn(loop: asyncio.AbstractEventLoop, writes: RequestWrites, names: list[str]) -> None:
    """Start requests `names` (one job each) in one turn of the event loop."""

    async def start() -> None:
        await asyncio.gather(*(
            writes.start(name, f"1 {name}".encode(), [GenerateRequest(f"{name}-0", REPLY,
                                                                      input_ids=[1])])
            for name in names
        ))  # fmt: skip

    loop.run_until_complete(start())


def _calls(client: redis.Redis) -> dict[str, int]:
    return {name: stats["calls"] for name, stats in client.info("commandstats").items()}


def _without_msetex(server: EmbeddedRedis) -> None:
    """The same server, restarted as one that has no MSETEX (as before Valkey 9.1)."""
    server.kill()
    server._args += ["--rename-command", "MSETEX", '""']
    server.revive()


def _records(client: redis.Redis, config: BusConfig, names: list[str]) -> None:
    for name in names:
        assert client.get(config.request_key(name)) == f"1 {name}".encode()
        assert 0 < client.ttl(config.request_key(name)) <= config.reply_ttl_s


def test_a_turns_request_keys_go_in_one_msetex_and_in_sets_once_the_server_lacks_it():
    loop = asyncio.new_event_loop()
    with EmbeddedRedis() as server:
        config = BusConfig(redis_url=server.url)
        client = redis.Redis.from_url(server.url)
        writes = RequestWrites(aredis.Redis.from_url(server.url), config, ModelLimits())
        client.config_resetstat()
        _turn(loop, writes, ["a", "b", "c"])
        calls = _calls(client)
        assert calls["cmdstat_msetex"] == 1 and "cmdstat_set" not in calls
        _records(client, config, ["a", "b", "c"])
        assert client.xlen(config.tokenized_stream()) == 1  # the jobs, in the same MULTI

        _without_msetex(server)
        client = redis.Redis.from_url(server.url)
        _turn(loop, writes, ["d", "e"])  # refused in the MULTI: written again with SETs
        assert _calls(client)["cmdstat_set"] == 2
        _records(client, config, ["d", "e"])
        assert client.xlen(config.tokenized_stream()) == 1  # once: the refused MULTI wrote none
        client.config_resetstat()
        _turn(loop, writes, ["f", "g"])  # SETs at once: MSETEX is not tried again
        assert _calls(client) == {"cmdstat_multi": 1, "cmdstat_set": 2, "cmdstat_xadd": 1,
                                  "cmdstat_exec": 1, "cmdstat_config|resetstat": 1}  # fmt: skip
        _records(client, config, ["f", "g"])
        client.close()
        loop.run_until_complete(writes.client.aclose())
    loop.close()


def test_an_ingress_starting_on_a_server_without_msetex_sets_each_key():
    loop = asyncio.new_event_loop()
    with EmbeddedRedis() as server:
        _without_msetex(server)
        config = BusConfig(redis_url=server.url)
        client = redis.Redis.from_url(server.url)
        writes = RequestWrites(aredis.Redis.from_url(server.url), config, ModelLimits())
        _turn(loop, writes, ["a", "b"])
        _records(client, config, ["a", "b"])
        assert client.xlen(config.tokenized_stream()) == 1
        client.close()
        loop.run_until_complete(writes.client.aclose())
    loop.close()
