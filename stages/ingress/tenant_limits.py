"""A tenant's limits, kept in Redis so every ingress replica counts the same requests.

- Requests running: a sorted set ``<p>:tenant:<id>:running`` of request ids scored by when
  their lease ends. The replica serving a request renews its lease (`renew`); a replica
  that dies stops renewing, and its requests drop out of the count within ``LEASE_S``.
- Tokens per minute: a hash ``<p>:tenant:<id>:tokens`` of per-second buckets, added to as
  each request ends (prompt plus completion tokens), summed over the last 60 s.

One script checks both and takes a running slot, atomically: two replicas cannot both take
a tenant's last slot. A request is let in while the tenant is under its token limit, so it
can overshoot by one request's tokens, as counting only what was used must.
"""

from __future__ import annotations

import time

import redis.asyncio as aredis

from bus.config import BusConfig
from stages.ingress.errors import ApiError
from stages.ingress.tenants import Tenant

LEASE_S = 60  # a running request's slot, renewed every LEASE_S / 3 by its replica
WINDOW_S = 60

_ADMIT = """
local now = tonumber(ARGV[1])
local max_running, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
if max_running > 0 then
  redis.call('zremrangebyscore', KEYS[1], '-inf', now)
  if redis.call('zcard', KEYS[1]) >= max_running then return {1, 1} end
end
if tpm > 0 then
  local buckets = redis.call('hgetall', KEYS[2])
  local seconds, used = {}, 0
  for i = 1, #buckets, 2 do
    local second, tokens = tonumber(buckets[i]), tonumber(buckets[i + 1])
    if second <= now - ARGV[5] then
      redis.call('hdel', KEYS[2], buckets[i])
    else
      used = used + tokens
      table.insert(seconds, {second, tokens})
    end
  end
  if used >= tpm then
    -- Retry once enough of the oldest buckets have left the window.
    table.sort(seconds, function(a, b) return a[1] < b[1] end)
    for _, bucket in ipairs(seconds) do
      used = used - bucket[2]
      if used < tpm then return {2, math.ceil(bucket[1] + ARGV[5] - now)} end
    end
    return {2, tonumber(ARGV[5])}
  end
end
if max_running > 0 then
  redis.call('zadd', KEYS[1], now + ARGV[6], ARGV[4])
  redis.call('expire', KEYS[1], 2 * ARGV[6])
end
return {0, 0}
"""


class TenantLimits:
    def __init__(self, client: aredis.Redis, config: BusConfig) -> None:
        self.client = client
        self.config = config
        self._admit = client.register_script(_ADMIT)

    def _key(self, tenant: Tenant, what: str) -> str:
        return f"{self.config.stream_prefix}:tenant:{tenant.id}:{what}"

    async def admit(self, tenant: Tenant, request_id: str) -> None:
        """Take a running slot for `request_id`, or raise a 429 saying which limit."""
        if not tenant.limited:
            return
        keys = [self._key(tenant, "running"), self._key(tenant, "tokens")]
        args = [time.time(), tenant.max_concurrent or 0, tenant.tokens_per_minute or 0,
                request_id, WINDOW_S, LEASE_S]  # fmt: skip
        refused, retry_after = await self._admit(keys=keys, args=args)
        if refused == 1:
            message = f"{tenant.max_concurrent} requests of this API key are running already"
        elif refused == 2:
            message = f"this API key used its {tenant.tokens_per_minute} tokens per minute"
        else:
            return
        raise ApiError(429, message + "; retry later", "rate_limit_exceeded", None,
                       "rate_limit_exceeded",
                       headers={"Retry-After": str(max(1, int(retry_after)))})  # fmt: skip

    async def release(self, tenant: Tenant, request_id: str, tokens: int) -> None:
        """The request ended, having used `tokens`: free its slot, count its tokens."""
        if not tenant.limited:
            return
        pipe = self.client.pipeline(transaction=True)
        if tenant.max_concurrent is not None:
            pipe.zrem(self._key(tenant, "running"), request_id)
        if tenant.tokens_per_minute is not None and tokens:
            key = self._key(tenant, "tokens")
            pipe.hincrby(key, str(int(time.time())), tokens)
            pipe.expire(key, 2 * WINDOW_S)
        await pipe.execute()

    async def renew(self, running: dict[str, Tenant]) -> None:
        """Extend the slots of the requests this replica serves (request id -> tenant)."""
        pipe = self.client.pipeline(transaction=False)
        until = time.time() + LEASE_S
        for request_id, tenant in running.items():
            if tenant.max_concurrent is not None:
                pipe.zadd(self._key(tenant, "running"), {request_id: until}, xx=True)
        await pipe.execute()
