"""A Redis Cluster deployment's live picture: each shard's (deployment_status.py) joined.

Each shard runs a pipeline of its own (runtime/cluster.py), so a stage's figures are the sums
over the shards and its replicas all of theirs; workers carry their ``shard``. The Redis
figures are per shard under ``shards`` (how close each is to its limit is what an operator
needs), and ``redis`` stays the home shard's. On one server the picture is that server's,
unchanged.
"""

from __future__ import annotations

from typing import Any

import redis

from observability.deployment_status import read_status
from runtime.config import BusConfig

_SUMMED = ("length", "lag", "pending", "entries_per_s")


def read_deployment_status(shards: list[tuple[redis.Redis, BusConfig]]) -> dict[str, Any]:
    """`shards`: a client and the names of each shard, the home shard first."""
    parts = [(config.shard, read_status(client, config)) for client, config in shards]
    if len(parts) == 1:
        return parts[0][1]
    merged = dict(parts[0][1])
    merged["stages"] = [_stage([p["stages"][i] for _, p in parts])
                        for i in range(len(merged["stages"]))]  # fmt: skip
    merged["workers"] = [{**w, "shard": shard} for shard, p in parts for w in p["workers"]]
    for section in ("throughput", "totals"):
        merged[section] = {key: value if key == "window_s" else sum(p[section][key]
                                                                    for _, p in parts)
                           for key, value in merged[section].items()}  # fmt: skip
    merged["dead_letters"] = sum(p["dead_letters"] for _, p in parts)
    routing: dict[str, int] = {}
    for _, part in parts:
        for reason, count in part["routing"].items():
            routing[reason] = routing.get(reason, 0) + count
    merged["routing"] = dict(sorted(routing.items()))
    merged["shards"] = [
        {"shard": shard, "redis": p["redis"], "workers": len(p["workers"]),
         "queued": sum(s["lag"] for s in p["stages"]), "dead_letters": p["dead_letters"]}
        for shard, p in parts
    ]  # fmt: skip
    return merged


def _stage(same: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage over the shards."""
    stage = dict(same[0])
    for key in _SUMMED:
        values = [s[key] for s in same if s[key] is not None]
        stage[key] = sum(values) if values else None
    stage["replicas"] = [r for s in same for r in s["replicas"]]
    return stage
