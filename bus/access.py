"""Wrong Redis credentials fail at start-up, once, with a message that says so.

redis-py raises ``AuthenticationError`` for a bad password or an unknown or disabled user,
and that class is a ``ConnectionError``: the reconnect loops, which rightly retry an
unreachable server, would retry it forever. An ACL user without the commands or keys the
bus needs (``NoPermissionError``) would fail much later, mid-request. Both are checked here
before a process starts its work. An unreachable server is not: under compose Redis may
still be starting, and the reconnect loops wait for it.

On a Redis Cluster a process checks on the shard it attached to (`attach_checked` here, over
runtime/cluster.py's `attach`), under that shard's names. A check made on a node by a URL
alone may hash its probe to another node's slot: the MOVED reply still proves the user may
write (a server checks ACLs before it redirects).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.exceptions import AskError, AuthorizationError, MovedError, NoPermissionError

from runtime.cluster import attach
from runtime.config import BusConfig

logger = logging.getLogger(__name__)

PROBE_TTL_MS = 10_000


class BusAccessError(ValueError):
    """The server refused these credentials, or this user may not use the bus's keys."""


def check_access(client: redis.Redis, config: BusConfig) -> None:
    """One PING and one write under the stream prefix, as the configured user."""
    probe = config.key_name("access-probe")
    try:
        client.ping()
        client.set(probe, b"1", px=PROBE_TTL_MS)
    except (redis.AuthenticationError, AuthorizationError) as exc:
        raise BusAccessError(
            f"Redis at {redacted(config.redis_url)} refused the credentials: {exc}. "
            "Put the user and password in the URL: redis://USER:PASSWORD@HOST:PORT"
        ) from exc
    except NoPermissionError as exc:
        raise BusAccessError(
            f"Redis at {redacted(config.redis_url)}: the user may not use the bus: {exc}. "
            f"It needs read and write access to the keys {config.stream_prefix}:* "
            f"(e.g. ACL SETUSER <user> ~{config.stream_prefix}:* +@all -@dangerous)"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError):
        pass  # not up yet: the reconnect loops wait for it
    except (MovedError, AskError):
        pass  # a cluster node that does not own the probe's slot: allowed, and redirected


def attach_checked(config: BusConfig, role: str) -> BusConfig:
    """The config a process of `role` runs with (`runtime.cluster.attach`: its shard's on a
    cluster, else `config`), its access checked there; refused credentials are explained
    as `check_access` explains them."""
    try:
        attached = attach(config, role)
    except (redis.AuthenticationError, AuthorizationError, NoPermissionError):
        with redis.Redis.from_url(config.redis_url) as client:
            check_access(client, config)  # raises BusAccessError saying what to do
        raise
    with redis.Redis.from_url(attached.redis_url) as client:
        check_access(client, attached)
    if attached is not config:
        logger.info("%s: attached to cluster shard %s at %s", role, attached.shard,
                    redacted(attached.redis_url))  # fmt: skip
    return attached


def redacted(url: str | None) -> str:
    """The URL without its password, fit for a log line."""
    if not url:
        return str(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
