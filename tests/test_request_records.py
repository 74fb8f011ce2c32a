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


def test_a_turns_starts_and_ends_share_one_round_trip_and_the_shard_writes_one_at_a_time():
    """Ends go after the starts' EXEC in the same round trip; starts asked while a round
    trip is under way (here, held by a paused server) go together in the next MULTI."""
    loop = asyncio.new_event_loop()
    with EmbeddedRedis() as server:
        config = BusConfig(redis_url=server.url)
        client = redis.Redis.from_url(server.url)
        writes = RequestWrites(aredis.Redis.from_url(server.url), config, ModelLimits())
        _turn(loop, writes, ["a", "b"])

        async def start_c_ending_a_and_b() -> None:
            writes.end("a", [], {})
            writes.end("b", [], {})
            await _start(writes, "c")

        client.config_resetstat()
        loop.run_until_complete(start_c_ending_a_and_b())
        calls = _calls(client)
        assert calls["cmdstat_multi"] == 1 and calls["cmdstat_del"] == 1
        assert client.exists(config.request_key("a"), config.request_key("b")) == 0
        _records(client, config, ["c"])

        async def starts_in_three_turns_one_held() -> None:
            first = asyncio.ensure_future(_start(writes, "d"))
            await asyncio.sleep(0.05)  # its round trip waits for the paused server
            later = []
            for name in ("e", "f"):  # a turn each
                later.append(asyncio.ensure_future(_start(writes, name)))
                await asyncio.sleep(0.01)
            client.client_unpause()
            await asyncio.gather(first, *later)

        client.config_resetstat()
        client.client_pause(5000, all=False)  # writes wait; CONFIG and CLIENT do not
        loop.run_until_complete(starts_in_three_turns_one_held())
        calls = _calls(client)
        assert calls["cmdstat_multi"] == 2 and calls["cmdstat_exec"] == 2
        _records(client, config, ["d", "e", "f"])
        client.close()
        loop.run_until_complete(writes.client.aclose())
    loop.close()


async def _start(writes: RequestWrites, name: str) -> None:
    await writes.start(name, f"1 {name}".encode(), [GenerateRequest(f"{name}-0", REPLY,
                                                                    input_ids=[1])])  # fmt: skip
