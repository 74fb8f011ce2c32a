"""An asyncio Redis client whose commands wait for a free connection rather than fail.

redis-py's asyncio pool allows 100 connections unless told otherwise, and the 101st
concurrent command raises MaxConnectionsError ("Too many connections"), a ConnectionError:
an ingress with 256 streams in flight answered most new requests 503 "Redis unreachable"
with Redis healthy. A blocking pool keeps a bounded number of connections per process
(Redis's own limit is shared by every replica) and queues commands beyond it for up to
`wait_s`; each command holds a connection for about a round trip.
"""

from __future__ import annotations

import redis.asyncio as aredis

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
