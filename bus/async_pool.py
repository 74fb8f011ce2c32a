"""An asyncio Redis client whose commands wait for a free connection rather than fail.

redis-py's asyncio pool allows 100 connections unless told otherwise, and the 101st
concurrent command raises MaxConnectionsError ("Too many connections"), a ConnectionError:
an ingress with 256 streams in flight answered most new requests 503 "Redis unreachable"
with Redis healthy. A blocking pool keeps a bounded number of connections per process
(Redis's own limit is shared by every replica) and queues commands beyond it for up to
`wait_s`; each command holds a connection for about a round trip.

`send_packed` sends on a connection a reader keeps for itself (the ingress's request writes,
reply reads and queue-depth reads), without the Task redis-py's send starts for each
command; `round_trip` sends commands on one and reads their replies, without the pipeline
machinery around them; `pack` packs what they send.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Sequence
from typing import Any

import hiredis
import redis
import redis.asyncio as aredis
from redis.asyncio.connection import Connection

if sys.version_info >= (3, 11, 3):  # as redis-py picks it: asyncio's, where it is fixed
    from asyncio import timeout as async_timeout
else:  # redis-py depends on this package before then
    from async_timeout import timeout as async_timeout

POOL_SIZE = 128
WAIT_S = 10.0


def async_redis(
    url: str,
    *,
    socket_connect_timeout: float,
    socket_timeout: float | None = None,
    pool_size: int = POOL_SIZE,
    wait_s: float = WAIT_S,
) -> aredis.Redis:
    pool = aredis.BlockingConnectionPool.from_url(
        url,
        max_connections=pool_size,
        timeout=wait_s,
        socket_connect_timeout=socket_connect_timeout,
        socket_timeout=socket_timeout,
    )
    return aredis.Redis.from_pool(pool)  # closing the client closes the pool


def pack(connection: Connection, commands: Sequence[tuple]) -> list[bytes]:
    """`connection.pack_commands(commands)`, by hiredis's packer in C where it takes every
    argument, as redis-py's synchronous client packs: its asyncio connection packs in Python,
    ~15 us a request's MULTI and ~4 us a reply read's XREAD, against ~2 and ~0.7. A command
    hiredis does not take (a bool or a memoryview argument, a name of two words such as
    "CONFIG GET") is packed by redis-py, which splits it or says what is wrong."""
    if not all(_one_word(command[0]) for command in commands):
        return connection.pack_commands(commands)
    try:
        return [b"".join([hiredis.pack_command(command) for command in commands])]
    except TypeError:
        return connection.pack_commands(commands)


def _one_word(name: Any) -> bool:
    if isinstance(name, str):
        return " " not in name
    return isinstance(name, bytes) and b" " not in name


async def send_packed(connection: Connection, packed: list[bytes]) -> None:
    """`connection.send_packed_command(packed, check_health=False)` without the Task it starts
    per send: where a socket timeout is set, redis-py wraps each send in `asyncio.wait_for`,
    a Task of its own on Python 3.11, ~20 us of a ~75 us round trip on the embedded server.
    The timeout still bounds a send that must wait for the server to read (a full buffer);
    a connection not yet open is opened by redis-py's send."""
    writer = getattr(connection, "_writer", None)  # redis-py's asyncio StreamWriter
    if writer is None or not connection.is_connected:
        await connection.send_packed_command(packed, check_health=False)
        return
    try:
        writer.writelines(packed)
        if writer.transport.get_write_buffer_size():  # the server reads slowly: wait, bounded
            await asyncio.wait_for(writer.drain(), connection.socket_timeout)
        else:
            await writer.drain()  # returns at once, or raises for a connection lost
    except asyncio.TimeoutError:
        await connection.disconnect(nowait=True)
        raise redis.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        await connection.disconnect(nowait=True)
        raise redis.ConnectionError(f"Error while writing to socket: {exc}") from exc
    except BaseException:  # cancelled mid-send: the next round trip must not read its replies
        await connection.disconnect(nowait=True)
        raise


async def round_trip(connection: Connection, commands: list[tuple]) -> list[Any]:
    """Each command's reply, an error reply as its ResponseError. A connection that fails
    before its first reply is read is opened again and tried once more: one the server had
    closed (a restart, an idle timeout) took none of the commands."""
    packed = pack(connection, commands)
    try:
        await send_packed(connection, packed)
        first = await _reply(connection)
    except redis.ConnectionError:
        await connection.disconnect()
        await send_packed(connection, packed)
        first = await _reply(connection)
    if len(commands) == 1:
        return [first]
    # The rest came with the first (the server answers a batch together), so they are read
    # under one timeout, not redis-py's one a reply: its timeout context per read was ~4% of
    # the ingress's CPU. Timed out, the connection is closed as redis-py's read would.
    try:
        async with async_timeout(connection.socket_timeout):
            rest = [await _reply(connection, math.inf) for _ in commands[1:]]
    except asyncio.TimeoutError:
        await connection.disconnect(nowait=True)
        raise redis.TimeoutError("Timeout reading from the Redis server") from None
    return [first, *rest]


async def _reply(connection: Connection, timeout: float | None = None) -> Any:
    """The next reply, within `timeout` (None: the connection's socket timeout; math.inf:
    none of its own)."""
    try:
        return await connection.read_response(timeout=timeout)
    except redis.ResponseError as exc:  # read whole: the next reply follows
        return exc
