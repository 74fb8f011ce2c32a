"""A tenant's limits, kept in Redis so every ingress replica counts the same requests.

- Sequences running: a sorted set ``<p>:tenant:<id>:running`` of sub-request ids (one per
  choice: ``n`` x prompts of each request) scored by when their lease ends. The replica
  serving them renews their leases (`renew`); a replica that dies stops renewing, and its
  sequences drop out of the count within ``LEASE_S``. A request with more sequences than
  the limit could ever run is a 400 (a 429 would have it retry for ever).
- Tokens per minute: a hash ``<p>:tenant:<id>:tokens`` of per-second buckets, summed over
  the last ``WINDOW_S`` seconds. Tokens are charged as the ingress learns of them: a prompt
  of token ids when it is submitted, completion tokens as their replies arrive, and the rest
  of a sub-request's prompt and completion (its Finish's counts) when it ends, whether it
  finished or its client went away (stages/ingress/streaming/submission.py). `charge` only adds to
  this replica's tally; the tally reaches Redis in one pipeline per ``CHARGE_INTERVAL_S``
  (an HINCRBY and an EXPIRE per tenant charged), and at once when one of the tenant's
  requests ends (with its ZREM), so Redis sees no command per token. A replica that dies
  loses at most that interval's tally.

One script checks both and takes the running slots, atomically: two replicas cannot both
take a tenant's last slot. A request is let in while the tenant is under its token limit,
so it can overshoot by what its own requests then generate, as counting only what was used
must.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import redis.asyncio as aredis

from runtime.config import BusConfig
from stages.ingress.errors import ApiError
from stages.ingress.tenancy.tenants import Tenant

LEASE_S = 60  # a running sequence's slot, renewed every LEASE_S / 3 by its replica
WINDOW_S = 60
CHARGE_INTERVAL_S = 1.0  # how often a replica's tally of tokens charged reaches Redis

_ADMIT = """
local now = tonumber(ARGV[1])
local max_running, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local wanted = #ARGV - 5  -- the request's sub-request ids, ARGV[6] on
if max_running > 0 then
  redis.call('zremrangebyscore', KEYS[1], '-inf', now)
  if redis.call('zcard', KEYS[1]) + wanted > max_running then return {1, 1} end
end
if tpm > 0 then
  local buckets = redis.call('hgetall', KEYS[2])
  local seconds, used = {}, 0
  for i = 1, #buckets, 2 do
    local second, tokens = tonumber(buckets[i]), tonumber(buckets[i + 1])
    if second <= now - ARGV[4] then
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
      if used < tpm then return {2, math.ceil(bucket[1] + ARGV[4] - now)} end
    end
    return {2, tonumber(ARGV[4])}
  end
end
if max_running > 0 then
  local slots = {}
  for i = 6, #ARGV do
    table.insert(slots, now + ARGV[5])
    table.insert(slots, ARGV[i])
  end
  redis.call('zadd', KEYS[1], unpack(slots))
  redis.call('expire', KEYS[1], 2 * ARGV[5])
end
return {0, 0}
"""


class TenantLimits:
    def __init__(self, client: aredis.Redis, config: BusConfig) -> None:
        self.client = client
        self.config = config
        self._admit = client.register_script(_ADMIT)
        self._tally: Counter[str] = Counter()  # tokens key -> charged, not yet in Redis

    def _key(self, tenant: Tenant, what: str) -> str:
        return self.config.key_name("tenant", tenant.id, what)

    async def admit(self, tenant: Tenant, rids: Sequence[str]) -> None:
        """Take a running slot for each of a request's sub-requests `rids`, or raise: a 400
        if they are more than the tenant may ever run, a 429 saying which limit is full."""
        if not tenant.limited:
            return
        if tenant.max_concurrent is not None and len(rids) > tenant.max_concurrent:
            raise ApiError(400, f"this request asks for {len(rids)} sequences (prompts x n); "
                           f"this API key may run at most {tenant.max_concurrent} at once",
                           param="n", code="too_many_sequences")  # fmt: skip
        keys = [self._key(tenant, "running"), self._key(tenant, "tokens")]
        args = [time.time(), tenant.max_concurrent or 0, tenant.tokens_per_minute or 0,
                WINDOW_S, LEASE_S, *rids]  # fmt: skip
        refused, retry_after = await self._admit(keys=keys, args=args)
        if refused == 1:
            message = (f"this API key's {tenant.max_concurrent} sequences at once would be "
                       f"passed: {len(rids)} more asked for, others running")  # fmt: skip
        elif refused == 2:
            message = f"this API key used its {tenant.tokens_per_minute} tokens per minute"
        else:
            return
        raise ApiError(429, message + "; retry later", "rate_limit_exceeded", None,
                       "rate_limit_exceeded",
                       headers={"Retry-After": str(max(1, int(retry_after)))})  # fmt: skip

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Count `tokens` against the tenant's tokens per minute (sent by `flush`)."""
        if tenant.tokens_per_minute is not None and tokens > 0:
            self._tally[self._key(tenant, "tokens")] += tokens

    async def flush(self) -> None:
        """Send the tokens charged since the last flush, in this second's buckets."""
        tally, self._tally = self._tally, Counter()
        if not tally:
            return
        pipe = self.client.pipeline(transaction=False)
        self._add_tally(pipe, tally)
        try:
            await pipe.execute()
        except BaseException:
            self._tally.update(tally)  # sent with the next flush instead
            raise

    def _add_tally(self, pipe, tally: Mapping[str, int]) -> None:
        second = str(int(time.time()))
        for key, tokens in tally.items():
            pipe.hincrby(key, second, tokens)
            pipe.expire(key, 2 * WINDOW_S)

    async def release(self, tenant: Tenant, rids: Iterable[str]) -> None:
        """The request ended: free its sub-requests' slots, and send the tenant's tally
        (so its next request is admitted on what this one used)."""
        if not tenant.limited:
            return
        pipe = self.client.pipeline(transaction=True)
        if tenant.max_concurrent is not None:
            pipe.zrem(self._key(tenant, "running"), *rids)
        key = self._key(tenant, "tokens")
        tokens = self._tally.pop(key, 0)
        if tokens:
            self._add_tally(pipe, {key: tokens})
        try:
            await pipe.execute()
        except BaseException:
            if tokens:
                self._tally[key] += tokens  # sent with the next flush instead
            raise

    async def renew(self, running: Mapping[str, Tenant]) -> None:
        """Extend the slots of the sub-requests this replica serves (rid -> tenant)."""
        by_key: dict[str, dict[str, float]] = {}
        until = time.time() + LEASE_S
        for rid, tenant in running.items():
            if tenant.max_concurrent is not None:
                by_key.setdefault(self._key(tenant, "running"), {})[rid] = until
        if not by_key:
            return
        pipe = self.client.pipeline(transaction=False)
        for key, slots in by_key.items():
            pipe.zadd(key, slots, xx=True)
        await pipe.execute()
