"""More concurrent commands than connections wait for one instead of failing."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aredis

from bus.async_pool import async_redis

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
