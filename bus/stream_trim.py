"""Trimming a stream read by consumer groups: only below what every group has acknowledged.

An XADD never trims (a count would cut entries no group has read or acknowledged, and a
job trimmed that way vanishes with no reply). Instead each consumer of a stream trims it
now and then, at most once per ``trim_interval_s``: one ``XINFO GROUPS``, an ``XPENDING``
summary of each group that holds pending entries, and one ``XTRIM MINID``. The id kept is
the lowest one some group still needs:

- a group's oldest pending entry (delivered, not acknowledged: a consumer may die with it,
  and a peer claims it), else
- the first entry after its last-delivered id (not yet read by the group).

A stream with no group yet is not trimmed: its first group starts from id 0 and must see
every entry. Replicas of one stage trim the same stream; the trims commute (each removes
only what every group is done with), so no coordination is needed. The race with a
consumer acknowledging or reading between the XINFO and the XTRIM only makes the trim keep
more than it could. XTRIM is allowed while Redis is at ``maxmemory``: trimming is how
memory comes back.

Cost: about three commands per stream per interval and per consumer, none per entry.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

logger = logging.getLogger(__name__)


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _after(entry_id: bytes | str) -> tuple[int, int]:
    ms, seq = parse_id(entry_id)
    return ms, seq + 1


def _field(info: dict[Any, Any], name: str) -> Any:
    # RESP2 gives str keys through redis-py's parser; be tolerant of bytes too.
    return info.get(name, info.get(name.encode()))


def trim_floor(client: redis.Redis, stream: str) -> tuple[int, int] | None:
    """The lowest id that some group of `stream` still needs; None: keep everything (no
    group, or no stream)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None  # no such stream
    if not groups:
        return None
    pending_groups = [g for g in groups if _field(g, "pending")]
    summaries: list[Any] = []
    if pending_groups:
        pipe = client.pipeline(transaction=False)
        for group in pending_groups:
            pipe.xpending(stream, _field(group, "name"))
        summaries = pipe.execute()
    oldest_pending = {
        _field(group, "name"): summary["min"]
        for group, summary in zip(pending_groups, summaries, strict=True)
        if summary and summary.get("min") is not None
    }
    floors = []
    for group in groups:
        floor = _after(_field(group, "last-delivered-id"))
        pending = oldest_pending.get(_field(group, "name"))
        if pending is not None:
            floor = min(floor, parse_id(pending))
        floors.append(floor)
    return min(floors)


def trim_acknowledged(client: redis.Redis, stream: str) -> int:
    """Remove the entries of `stream` that every group has acknowledged; the count removed."""
    floor = trim_floor(client, stream)
    if floor is None:
        return 0
    # Exact, not `~`: the few entries of a partial node are not worth keeping a job's
    # payload around for, and the removal is O(entries removed) once per interval.
    return client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False)


class StreamTrimmer:
    """A consumer's trims of its input stream, at most once per `interval_s`; call `maybe_trim`
    from its loop. Transient Redis errors propagate to the loop's reconnect policy."""

    def __init__(self, client: redis.Redis, stream: str, interval_s: float) -> None:
        self.client = client
        self.stream = stream
        self.interval_s = interval_s
        self._next = time.monotonic() + interval_s
        self.trimmed = 0

    def maybe_trim(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        try:
            self.trimmed += trim_acknowledged(self.client, self.stream)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except redis.RedisError as exc:  # a trim is housekeeping: never worth a dead stage
            logger.warning("%s: could not trim: %s", self.stream, exc)
