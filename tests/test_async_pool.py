"""More concurrent commands than connections wait for one instead of failing; a kept
connection's sends (`send_packed`, `pack`)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aredis

from bus.async_pool import async_redis, pack, round_trip, send_packed

CONCURRENT = 40


async def _hold_connections(client: aredis.Redis) -> list:
    # Each BLPOP holds its connection for 0.1 s: 40 at once against a pool of 8.
    try:
        return await asyncio.gather(
            *[client.blpop([f"empty-{i}"], timeout=0.1) for i in range(CONCURRENT)]
        )
    finally:
        await client.aclose()


def test_commands_beyond_the_pool_wait_for_a_connection(redis_url):
    client = async_redis(redis_url, socket_connect_timeout=2, pool_size=8, wait_s=10)
    assert asyncio.run(_hold_connections(client)) == [None] * CONCURRENT


def test_redis_pys_default_pool_fails_them_instead(redis_url):
    """What the blocking pool is for: the plain pool raises past its size."""
    client = aredis.Redis.from_url(redis_url, max_connections=8)
    with pytest.raises(redis.ConnectionError, match="Too many connections"):
        asyncio.run(_hold_connections(client))


async def _sends(url: str) -> list:
    client = async_redis(url, socket_connect_timeout=2, socket_timeout=2)
    connection = await client.connection_pool.get_connection()
    try:
        seen = []
        # Not yet open: redis-py's send opens it.
        await send_packed(connection, connection.pack_commands([("SET", "sp", 1), ("GET", "sp")]))
        seen += [await connection.read_response(), await connection.read_response()]
        # The server drops it (a restart, an idle timeout): an error, not a hang, then the
        # same connection opened again by the next send.
        await client.client_kill_filter(skipme=True, _type="normal")
        with pytest.raises(redis.ConnectionError):
            await send_packed(connection, connection.pack_command("GET", "sp"))
            await connection.read_response()
        await connection.disconnect()
        await send_packed(connection, connection.pack_command("GET", "sp"))
        seen.append(await connection.read_response())
        return seen
    finally:
        await client.connection_pool.release(connection)
        await client.aclose()


def test_send_packed_sends_and_a_dropped_connection_is_an_error(redis_url, redis_client):
    assert asyncio.run(_sends(redis_url)) == [b"OK", b"1", b"1"]


async def _cancelled_then_again(url: str) -> list:
    client = async_redis(url, socket_connect_timeout=2, socket_timeout=5)
    connection = await client.connection_pool.get_connection()
    try:
        await round_trip(connection, [("SET", "rt", 1)])
        await client.client_pause(400)  # the next reply waits: cancel the round trip then
        waiting = asyncio.create_task(round_trip(connection, [("GET", "rt")]))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # Its GET's reply must not be read as the next round trip's.
        return await round_trip(connection, [("INCR", "rt"), ("GET", "rt"), ("HGET", "rt", "x")])
    finally:
        await client.connection_pool.release(connection)
        await client.aclose()


def test_a_round_trip_cancelled_midway_leaves_the_connection_in_step(redis_url, redis_client):
    incr, get, wrong_type = asyncio.run(_cancelled_then_again(redis_url))
    assert (incr, get) == (2, b"2")
    assert isinstance(wrong_type, redis.ResponseError)  # an error reply is a value, in place


async def _later_reply_late(url: str) -> tuple:
    client = async_redis(url, socket_connect_timeout=2, socket_timeout=0.3)
    connection = await client.connection_pool.get_connection()
    try:
        # PING answers at once; BLPOP holds its reply for 2 s, past the socket timeout.
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            await round_trip(connection, [("PING",), ("BLPOP", "never-pushed", 2)])
        waited = time.monotonic() - started
        # The late reply must not be read as the next round trip's: a fresh connection.
        again = await round_trip(connection, [("SET", "late", 1), ("GET", "late")])
        return waited, again
    finally:
        await client.connection_pool.release(connection)
        await client.aclose()


def test_replies_after_the_first_are_bounded_by_the_socket_timeout(redis_url, redis_client):
    waited, again = asyncio.run(_later_reply_late(redis_url))
    assert waited < 1.5
    assert again == [b"OK", b"1"]  # replies as the server gives them


COMMANDS = [
    ("MULTI",),
    ("SET", "k", b"\x00\xff bytes", "EX", 600),
    ("XADD", "s", "MAXLEN", "~", 10**20, "*", "d", "été 😀"),
    ("ZADD", "z", 1.5, "a", -0.1, "b", 1e-07, "c"),
    ("EXEC",),
]


def test_pack_gives_redis_pys_bytes_and_falls_back_where_hiredis_cannot_pack():
    connection = aredis.Connection()
    assert pack(connection, COMMANDS) == [b"".join(connection.pack_commands(COMMANDS))]
    # Two words in a name, a memoryview: redis-py's packer, as it would pack them.
    for command in [("CONFIG GET", "maxmemory"), ("SET", "k", memoryview(b"value"))]:
        assert b"".join(pack(connection, [command])) == b"".join(
            connection.pack_commands([command])
        )
    with pytest.raises(redis.DataError):  # what redis-py refuses is refused as it says
        pack(connection, [("SET", "k", True)])


def test_round_trips_sent_by_pack_reach_the_server_whole(redis_url, redis_client):
    async def run() -> list:
        client = async_redis(redis_url, socket_connect_timeout=2, socket_timeout=2)
        connection = await client.connection_pool.get_connection()
        try:
            return await round_trip(connection, [*COMMANDS, ("GET", "k"), ("ZSCORE", "z", "c")])
        finally:
            await client.connection_pool.release(connection)
            await client.aclose()

    *_, executed, value, score = asyncio.run(run())
    assert executed[0] == b"OK" and value == b"\x00\xff bytes" and float(score) == 1e-07
