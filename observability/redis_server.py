"""The Redis-protocol server's own figures: how close the bus's shard is to its limits.

One ``INFO`` (the default sections) gives what an operator needs beside the pipeline's own
figures: the commands the server has processed (and their rate now), the CPU seconds it has
spent, its memory against ``maxmemory`` (past which, with ``noeviction``, it refuses writes),
and its clients. A server that will not answer ``INFO`` (an ACL user without it) has no
figures: None, and the readers show none rather than failing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerFigures:
    commands_processed: int  # since the server started
    ops_per_second: float  # the server's own instantaneous rate
    cpu_seconds: float  # user + system, since the server started
    memory_bytes: int  # used_memory
    maxmemory_bytes: int  # 0: no limit
    connected_clients: int


def read_server_figures(client: redis.Redis) -> ServerFigures | None:
    """The server's figures from one INFO, or None where INFO is refused."""
    try:
        info = client.info()
    except redis.ResponseError as exc:  # NOPERM: the operator left INFO out of the ACL
        logger.debug("INFO refused: %s", exc)
        return None
    return ServerFigures(
        commands_processed=int(info.get("total_commands_processed", 0)),
        ops_per_second=float(info.get("instantaneous_ops_per_sec", 0)),
        cpu_seconds=float(info.get("used_cpu_user", 0)) + float(info.get("used_cpu_sys", 0)),
        memory_bytes=int(info.get("used_memory", 0)),
        maxmemory_bytes=int(info.get("maxmemory", 0)),
        connected_clients=int(info.get("connected_clients", 0)),
    )
