"""Redis Cluster: the bus split into shards, one per primary, each a whole bus of its own.

A stage never talks to the cluster as a cluster. Each primary gets a short tag (`shard_tags`,
``s0``, ``s1``, ...) chosen so that ``{tag}`` hashes to one of that primary's slots; a
process attached to a shard names every stream and key ``<prefix>:{<tag>}:...``
(`BusConfig.shard`), so all its names live on that one primary and it uses a plain
connection to it: MULTI, pipelines and scripts work as on a single server. Shard 0 (the
primary owning slot 0's range, the first) is the *home* shard: state that is one per tenant
or deployment, rather than per job, lives there.

`attach` is what a process calls at start: on a plain server it changes nothing; on a
cluster (found by itself: `is_cluster`) it picks the shard named by ``STREAMSERVE_SHARD``,
else the one where its role has the fewest live replicas, so replicas started one after
another spread over the primaries. A replica started at the same moment as another may see
the same counts and pick the same shard: spreading is best effort, correctness is not at
stake (every shard is a complete bus).

If the slots move later (a reshard, a failover to a replica on another address), the
primary answers MOVED or ASK: `is_slot_moved` tells a process so, and it exits with one
clear line, for its supervisor to start it again and attach afresh.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.crc import key_slot as _redis_key_slot

from runtime.config import BusConfig
from runtime.key_ids import is_valid_id

logger = logging.getLogger(__name__)

SLOTS = 16384
CONNECT_TIMEOUT_S = 5.0
WAIT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)  # the last step repeated
WAIT_LOG_EVERY_S = 10.0
TAG_ATTEMPTS = 10_000  # ample: a range of a third of the slots takes ~3 tries on average
# The CPU stages' input stream and consumer group (each stage's class says the same; runtime/
# sits below stages/ and cannot ask them).
ROLE_INPUTS: dict[str, tuple[Callable[[BusConfig], str], str]] = {
    "tokenizer": (BusConfig.requests_stream, "tokenizer"),
    "router": (BusConfig.tokenized_stream, "router"),
    "detokenizer": (BusConfig.tokens_stream, "detokenizer"),
}
WORKER_ROLE = "worker"
INGRESS_ROLE = "ingress"  # counted by its replicas' liveness keys (frontend_key)
# A stage's or worker's exit code when its shard moved off the node it attached to: its
# supervisor starts it again, and it attaches afresh.
EXIT_SHARD_MOVED = 3

SlotRanges = list[tuple[int, int]]


class ClusterError(ValueError):
    """The cluster does not have the shard asked for (a setting to fix), or has no shard
    tag for a primary."""


class ClusterNotReady(ClusterError):
    """Some slots have no primary yet (the cluster is being made, or a primary is down)."""


def key_slot(name: str) -> int:
    """The cluster slot of a key name (CRC16 of its hash tag, if it has one, mod 16384)."""
    return _redis_key_slot(name.encode())


def is_cluster(client: redis.Redis) -> bool:
    """Whether the server runs in cluster mode. CLUSTER INFO is asked, not INFO: ACL users
    made as bus/access.py suggests (``-@dangerous``) may not run INFO."""
    try:
        client.execute_command("CLUSTER INFO")
        return True
    except redis.exceptions.NoPermissionError:
        try:  # a user without CLUSTER may still have INFO
            return bool(int(client.info("cluster").get("cluster_enabled", 0)))
        except redis.exceptions.NoPermissionError:
            return False  # neither: a cluster would refuse its jobs at once, and say why
    except redis.ResponseError as exc:
        if "cluster support disabled" in str(exc):
            return False
        raise


def node_url_for(url: str, host: str, port: int) -> str:
    """`url` with its host and port replaced: same scheme, credentials and options."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    netloc = f"{credentials}@{address}" if credentials else address
    return urlunsplit(parts._replace(netloc=netloc))


def cluster_primaries(url: str) -> list[tuple[str, SlotRanges]]:
    """Each primary's URL with the slot ranges it owns, ordered by first slot."""
    client = _client(url)
    try:
        reply = client.execute_command("CLUSTER SLOTS")
    finally:
        client.close()
    ranges: dict[tuple[str, int], SlotRanges] = {}
    for first, last, primary, *_replicas in reply:
        host = _text(primary[0])
        # An empty or '?' endpoint: the node does not know how it is reached; the address
        # we reached the cluster by does.
        if not host or host == "?":
            host = urlsplit(url).hostname or "127.0.0.1"
        ranges.setdefault((host, int(primary[1])), []).append((int(first), int(last)))
    covered = sum(last - first + 1 for r in ranges.values() for first, last in r)
    if covered != SLOTS:
        raise ClusterNotReady(f"{covered} of the {SLOTS} slots have a primary")
    primaries = [(node_url_for(url, host, port), sorted(r)) for (host, port), r in ranges.items()]
    return sorted(primaries, key=lambda primary: primary[1][0][0])


def shard_tags(primaries: list[tuple[str, SlotRanges]]) -> list[str]:
    """One tag per primary, in order: ``s<i>``, else ``s<i>-1``, ``s<i>-2``, ... the first
    whose ``{tag}`` hashes into that primary's slots. The same cluster layout always gives
    the same tags, so every process agrees on them without asking anyone."""
    tags = []
    for index, (url, ranges) in enumerate(primaries):
        for attempt in range(TAG_ATTEMPTS):
            tag = f"s{index}" if attempt == 0 else f"s{index}-{attempt}"
            slot = key_slot(f"{{{tag}}}")
            if any(first <= slot <= last for first, last in ranges):
                tags.append(tag)
                break
        else:
            raise ClusterError(f"no shard tag found for the primary at {url} ({ranges})")
    return tags


def shard_configs(config: BusConfig) -> list[BusConfig]:
    """One config per shard of a cluster (shard 0 first, the home shard), each with its
    primary's URL and its tag; ``[config]`` for a plain server."""
    if config.redis_url is None or config.redis_url.startswith("unix://"):
        return [config]
    client = _client(config.redis_url)
    try:
        clustered = is_cluster(client)
    finally:
        client.close()
    if not clustered:
        return [config]
    primaries = cluster_primaries(config.redis_url)
    return [
        dataclasses.replace(config, redis_url=url, shard=tag)
        for (url, _ranges), tag in zip(primaries, shard_tags(primaries), strict=True)
    ]


def attach(config: BusConfig, role: str, wait_s: float | None = None) -> BusConfig:
    """The config a process of `role` (``worker``, ``ingress``, or a CPU stage in
    `ROLE_INPUTS`) runs with: unchanged on a plain server; on a cluster, its shard's (the
    one in ``config.shard``, else the one where `role` has the fewest live replicas, the
    first of those on a tie). An unreachable server, or a cluster with slots not yet served, is
    waited for (`wait_s` at most; None: as long as it takes, as the reconnect loops do)."""
    if role not in (WORKER_ROLE, INGRESS_ROLE) and role not in ROLE_INPUTS:
        raise ValueError(f"attach: unknown role {role!r}; the roles are "
                         f"{', '.join((WORKER_ROLE, INGRESS_ROLE, *ROLE_INPUTS))}")  # fmt: skip
    shards = _wait_for_shards(config, wait_s)
    if len(shards) == 1 and shards[0] is config:
        return config  # a plain server
    if config.shard is not None:
        for shard in shards:
            if shard.shard == config.shard:
                return shard
        raise ClusterError(
            f"STREAMSERVE_SHARD={config.shard} is not a shard of this cluster; its shards "
            f"are {', '.join(str(s.shard) for s in shards)}"
        )
    counts = [live_replicas(shard, role) for shard in shards]
    chosen = shards[counts.index(min(counts))]
    logger.debug("%s: live replicas per shard %s", role, counts)
    return chosen


def client_shards(config: BusConfig) -> tuple[BusConfig, BusConfig]:
    """Where a program putting jobs straight on Redis (bus/client.py) sends them, and the
    home shard (batches and files): both `config` on a plain server; on a cluster, a shard
    picked at random among those with a live worker (any shard if none has one: the jobs
    wait there as on a server with no worker), so many clients spread over the shards."""
    shards = shard_configs(config)
    if len(shards) == 1:
        return shards[0], shards[0]
    served = [shard for shard in shards if live_replicas(shard, WORKER_ROLE)]
    return random.choice(served or shards), shards[0]


def _wait_for_shards(config: BusConfig, wait_s: float | None) -> list[BusConfig]:
    start = time.monotonic()
    last_log = start - WAIT_LOG_EVERY_S
    attempt = 0
    while True:
        try:
            return shard_configs(config)
        except (redis.AuthenticationError, redis.exceptions.NoPermissionError):
            raise  # no wait mends it (bus/access.py says what to do)
        except (redis.ConnectionError, redis.TimeoutError, ClusterNotReady) as exc:
            now = time.monotonic()
            if wait_s is not None and now - start >= wait_s:
                raise
            if now - last_log >= WAIT_LOG_EVERY_S:
                logger.warning("waiting for Redis at %s: %s", _address(config), exc)
                last_log = now
            time.sleep(WAIT_BACKOFF_S[min(attempt, len(WAIT_BACKOFF_S) - 1)])
            attempt += 1


def live_replicas(shard: BusConfig, role: str) -> int:
    """How many processes of `role` work on `shard` now: workers whose heartbeat key lives,
    or consumers of the stage's group that read within the claim time (a consumer of a
    process that died stays in the group, idle)."""
    client = _client(shard.redis_url)
    try:
        if role == WORKER_ROLE:
            # A member that could name no key is no worker's (bus/liveness.py's worker_ids).
            members = (m.decode(errors="replace") for m in client.smembers(shard.workers_key()))
            ids = [member for member in members if is_valid_id(member)]
            if not ids:
                return 0
            return sum(client.exists(shard.heartbeat_key(worker_id)) for worker_id in ids)
        if role == INGRESS_ROLE:
            return sum(1 for _ in client.scan_iter(match=shard.frontend_key("*"), count=1000))
        stream_of, group = ROLE_INPUTS[role]
        try:
            consumers = client.xinfo_consumers(stream_of(shard), group)
        except redis.ResponseError:
            return 0  # no stream or no group yet: nobody reads it
        return sum(1 for c in consumers if int(c.get("idle", 0)) < shard.claim_idle_ms)
    finally:
        client.close()


def is_slot_moved(exc: BaseException) -> bool:
    """Whether a Redis error says this shard is no longer served by the node we talk to:
    MOVED or ASK (inside a MULTI, redis-py may report it in the failing command's message),
    or CLUSTERDOWN (its slot has no primary for now: attaching again waits for one)."""
    redirected = (
        redis.exceptions.MovedError,
        redis.exceptions.AskError,
        redis.exceptions.ClusterDownError,
    )
    if isinstance(exc, redirected):
        return True
    message = str(exc)
    return isinstance(exc, redis.ResponseError) and (
        message.startswith(("MOVED ", "ASK ")) or " MOVED " in message or " ASK " in message
    )


def _address(config: BusConfig) -> str:
    """Host and port (no credentials), for a log line."""
    parts = urlsplit(config.redis_url or "")
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname or parts.path)


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
