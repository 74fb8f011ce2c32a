"""The Redis shards one ingress replica talks to (docs/ARCHITECTURE.md, "Redis Cluster").

On a Redis Cluster every process is attached to one shard (runtime/cluster.py), where all the
names it uses hash to one slot. An ingress replica submits its requests to its own shard
(`own`: the stages and workers there serve them) and reads their replies there. What belongs
to a tenant rather than to a request — files, batches, the tenants' running slots and token
budgets — lives on the home shard (the first), so every replica sees the same. A request
named by id (an abort, a resume with ``Last-Event-ID``) may have been submitted through any
replica: it is looked up on this replica's shard first, then on the others at once.

On a plain server there is one shard, the server, and all three are the same client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aredis

from runtime.cluster import shard_configs
from runtime.config import BusConfig


@dataclass(frozen=True)
class Shard:
    config: BusConfig
    redis: aredis.Redis


class Shards:
    def __init__(self, own: Shard, ordered: list[Shard]) -> None:
        self.own = own
        self.all = ordered  # every shard, in the cluster's order: the home shard first
        self.home = ordered[0]
        self.others = [shard for shard in ordered if shard is not own]

    @classmethod
    def connect(cls, config: BusConfig, client: Callable[[str], aredis.Redis]) -> Shards:
        """The shards of the deployment `config` belongs to, attached to its shard (by
        runtime/cluster.py's `attach`: no shard, no cluster); `client` makes an asyncio
        client for a URL. `own` keeps `config` as given."""
        own = Shard(config, client(config.redis_url))
        configs = [config] if config.shard is None else shard_configs(config)
        ordered = [own if c.shard == config.shard else Shard(c, client(c.redis_url))
                   for c in configs]  # fmt: skip
        return cls(own, ordered)

    async def read(self, key: Callable[[BusConfig], str]) -> tuple[Shard, bytes] | None:
        """The first shard holding the key `key` names there (this replica's first), with
        its value; None where no shard has it."""
        raw = await self.own.redis.get(key(self.own.config))
        if raw is not None or not self.others:
            return None if raw is None else (self.own, raw)
        found = await asyncio.gather(*(s.redis.get(key(s.config)) for s in self.others),
                                     return_exceptions=True)  # fmt: skip
        for shard, value in zip(self.others, found, strict=True):
            if value is not None and not isinstance(value, BaseException):
                return shard, value
        # A shard away may hold it: its error (a 503), not a 404 that says it is gone.
        for value in found:
            if isinstance(value, BaseException):
                raise value
        return None

    async def aclose(self) -> None:
        for shard in self.others:
            await shard.redis.aclose()
