"""The pipeline's streams as Redis sees them: length, and each consumer group's lag, pending
entries and consumers (XLEN, XINFO GROUPS, XINFO CONSUMERS), read in two round trips (the
lengths and groups, then the groups' consumers).

Lag is what the group has not read yet; pending, what it read and has not acknowledged. A
stage keeping up shows both near 0; lag that grows says the stage needs replicas. All three
count entries: on the job streams (requests, tokenized) one entry may bundle a whole
commit's jobs (jobs/wire.py), so there they are not job counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import redis

from runtime.config import BusConfig

# The stage that consumes each of the fixed streams.
STAGE_STREAMS = (("tokenizer", "requests_stream"), ("router", "tokenized_stream"),
                 ("detokenizer", "tokens_stream"))  # fmt: skip


@dataclass
class GroupStats:
    group: str
    lag: int  # entries not yet delivered to the group (0 when Redis cannot tell)
    pending: int
    consumers: dict[str, int]  # consumer name -> entries it holds pending


@dataclass
class StreamStats:
    stream: str
    length: int
    groups: list[GroupStats] = field(default_factory=list)


def pipeline_streams(config: BusConfig, worker_ids: Iterable[str]) -> dict[str, str]:
    """Stream name -> what reads it: each stage's input, the stream of each registered worker
    (`worker_ids`, alive or lapsed: bus/liveness.py) and its progress log (its token batches,
    which the detokenizers read: bus/fenced_stream.py), and the dead-letter stream."""
    streams = {getattr(config, method)(): stage for stage, method in STAGE_STREAMS}
    for worker_id in worker_ids:
        streams[config.worker_stream(worker_id)] = f"worker {worker_id}"
        streams[config.progress_stream(worker_id)] = "detokenizer"
    streams[config.dead_letter_stream()] = "dead letters"
    return streams


def read_stream_stats(client: redis.Redis, streams: list[str]) -> list[StreamStats]:
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
    replies = pipe.execute(raise_on_error=False)
    stats = []
    for i, stream in enumerate(streams):
        length, groups = replies[2 * i], replies[2 * i + 1]
        entry = StreamStats(stream, length if isinstance(length, int) else 0)
        if isinstance(groups, list):  # an error: the stream does not exist yet
            for info in groups:
                name = _text(info["name"])
                entry.groups.append(GroupStats(name, int(info.get("lag") or 0),
                                               int(info["pending"]), {}))  # fmt: skip
        stats.append(entry)
    _read_consumers(client, stats)
    return stats


def _read_consumers(client: redis.Redis, stats: list[StreamStats]) -> None:
    pairs = [(s, g) for s in stats for g in s.groups]
    if not pairs:
        return
    pipe = client.pipeline(transaction=False)
    for stream, group in pairs:
        pipe.xinfo_consumers(stream.stream, group.group)
    for (_, group), consumers in zip(pairs, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(consumers, list):
            group.consumers = {_text(c["name"]): int(c["pending"]) for c in consumers}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
