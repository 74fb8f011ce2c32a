"""What one owner's stored responses may hold: ``max_responses_per_owner`` responses and
``max_response_bytes_per_owner`` bytes (runtime/config.py).

Every ``/v1/responses`` call stores its answer for ``response_ttl_s`` (30 days) unless it
says ``store: false``, and a stored one keeps its input: a background response that failed
on a 500 KB prompt kept 1.6 MB. Nothing bounded that, so one tenant could fill the Redis
every tenant shares. Past either bound the owner's oldest responses are dropped to make
room (a 404 from then on, as after their expiry), rather than the new one refused: a
single-tenant server stores every answer it gives, and must keep answering.

Per owner, ``<p>:owner:<o>:responses`` orders its responses by expiry (their creation, to
the microsecond, as all live ``response_ttl_s``), ``<p>:owner:<o>:response-sizes`` holds
each one's bytes as created (its input and first state: what it adds as it runs is bounded
by its output) and ``<p>:owner:<o>:response-bytes`` their sum. One script stores a new
response and counts it, forgetting what expired on the way, so a create stays one round
trip; only a create that drops older responses makes a second, to delete them.
"""

from __future__ import annotations

import time

import redis.asyncio as aredis

from batch_store.files import OPEN_OWNER
from runtime.config import BusConfig

# KEYS: 1 the new response's hash, 2 the owner's responses by expiry, 3 their sizes, 4 their
# total, 5 the running background responses. ARGV: 1 now, 2 the id, 3 the TTL, 4 the most
# responses, 5 the most bytes, 6 "1" for a background response, 7 its size, 8... the hash's
# fields and values. Returns the ids dropped to make room (their hashes still to delete).
_CREATE = """
local now, id, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local most, most_bytes, size = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
local count = redis.call('zcard', KEYS[2])
local total = tonumber(redis.call('get', KEYS[4]) or '0')
local dropped = {}
for _ = 1, 1000 do -- bounded work a create: a lowered bound is reached over later ones
  local oldest = redis.call('zrange', KEYS[2], 0, 0, 'WITHSCORES')
  if #oldest == 0 then break end
  local expired = tonumber(oldest[2]) <= now
  if not expired and count < most and total + size <= most_bytes then break end
  local bytes = tonumber(redis.call('hget', KEYS[3], oldest[1]) or '0')
  redis.call('zrem', KEYS[2], oldest[1])
  redis.call('hdel', KEYS[3], oldest[1])
  count, total = count - 1, total - bytes
  if not expired then dropped[#dropped + 1] = oldest[1] end
end
redis.call('hset', KEYS[1], unpack(ARGV, 8))
redis.call('expire', KEYS[1], ttl)
if ARGV[6] == '1' then redis.call('sadd', KEYS[5], id) end
redis.call('zadd', KEYS[2], now + ttl, id)
redis.call('hset', KEYS[3], id, size)
redis.call('set', KEYS[4], total + size)
return dropped
"""
# KEYS: 2-4 as _CREATE's; ARGV[1] the id. Forgets a deleted response's size.
_FORGET = """
local bytes = tonumber(redis.call('hget', KEYS[2], ARGV[1]) or '0')
if redis.call('zrem', KEYS[1], ARGV[1]) == 1 then redis.call('decrby', KEYS[3], bytes) end
redis.call('hdel', KEYS[2], ARGV[1])
"""


class ResponseQuota:
    """The stored responses of every owner of one deployment, counted against its bounds."""

    def __init__(self, client: aredis.Redis, config: BusConfig) -> None:
        self.client = client
        self.config = config
        self._create = client.register_script(_CREATE)
        self._forget = client.register_script(_FORGET)

    def _usage(self, owner: str | None) -> list[str]:
        owner = owner or OPEN_OWNER
        return [self.config.key_name("owner", owner, name)
                for name in ("responses", "response-sizes", "response-bytes")]  # fmt: skip

    async def store(
        self, owner: str | None, response_id: str, key: str, background_index: str,
        fields: dict[str, str], background: bool,
    ) -> list[str]:  # fmt: skip
        """Write a new response's hash (`key`, expiring in response_ttl_s), counted to
        `owner`; the ids of the owner's older responses dropped to make room (their
        hashes deleted too)."""
        size = sum(len(name) + len(value.encode()) for name, value in fields.items())
        flat = [part for item in fields.items() for part in item]
        config = self.config
        dropped = await self._create(
            keys=[key, *self._usage(owner), background_index],
            args=[repr(time.time()), response_id, config.response_ttl_s,
                  config.max_responses_per_owner, config.max_response_bytes_per_owner,
                  int(background), size, *flat],
        )  # fmt: skip
        ids = [raw.decode() for raw in dropped]
        if ids:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(*(config.key_name("response", i) for i in ids))
            pipe.srem(background_index, *ids)
            await pipe.execute()
        return ids

    async def forget(self, owner: str | None, response_id: str) -> None:
        """A deleted response no longer counts."""
        await self._forget(keys=self._usage(owner), args=[response_id])

    async def usage(self, owner: str | None) -> tuple[int, int]:
        """(responses, bytes) `owner` holds, as last counted."""
        index, _, total = self._usage(owner)
        count, held = await self.client.zcard(index), await self.client.get(total)
        return count, int(held or 0)
