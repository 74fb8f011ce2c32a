"""Streams are trimmed only below what every consumer group has acknowledged
(bus/stream_trim.py): never an entry a group has not read, nor one it read and holds pending."""

from __future__ import annotations

from bus.stream_trim import StreamTrimmer, trim_acknowledged

STREAM = "t:trim"


def _add(client, count: int) -> list[bytes]:
    return [client.xadd(STREAM, {"n": str(i)}) for i in range(count)]


def _ids(client) -> list[bytes]:
    return [entry_id for entry_id, _ in client.xrange(STREAM)]


def _read(client, group: str, count: int) -> list[bytes]:
    entries = client.xreadgroup(group, f"{group}-c", {STREAM: ">"}, count=count)
    return [entry_id for entry_id, _ in entries[0][1]] if entries else []


def test_a_stream_without_a_group_is_never_trimmed(redis_client):
    _add(redis_client, 5)
    assert trim_acknowledged(redis_client, STREAM) == 0
    assert len(_ids(redis_client)) == 5
    assert trim_acknowledged(redis_client, "t:no-such-stream") == 0


def test_only_entries_every_group_acknowledged_are_removed(redis_client):
    ids = _add(redis_client, 10)
    for group in ("a", "b"):
        redis_client.xgroup_create(STREAM, group, id="0")
    # Group a: read 6, acknowledged the first 4 (5 and 6 pending). Group b: read 8, all acked.
    read_a = _read(redis_client, "a", 6)
    redis_client.xack(STREAM, "a", *read_a[:4])
    read_b = _read(redis_client, "b", 8)
    redis_client.xack(STREAM, "b", *read_b)

    assert trim_acknowledged(redis_client, STREAM) == 4
    assert _ids(redis_client) == ids[4:]  # a's pending ones and what neither acknowledged

    redis_client.xack(STREAM, "a", *read_a[4:])
    assert trim_acknowledged(redis_client, STREAM) == 2
    assert _ids(redis_client) == ids[6:]  # a has not read these yet

    read_a += _read(redis_client, "a", 10)
    redis_client.xack(STREAM, "a", *read_a[6:])
    assert trim_acknowledged(redis_client, STREAM) == 2
    assert _ids(redis_client) == ids[8:]  # b has not read these yet


def test_a_pending_entry_behind_acknowledged_ones_is_kept(redis_client):
    """A consumer that died holding the oldest entry: its peers acknowledged everything after
    it, and it is still there for them to claim."""
    ids = _add(redis_client, 5)
    redis_client.xgroup_create(STREAM, "g", id="0")
    read = _read(redis_client, "g", 5)
    redis_client.xack(STREAM, "g", *read[1:])
    trim_acknowledged(redis_client, STREAM)
    assert _ids(redis_client) == ids
    claimed = redis_client.xautoclaim(STREAM, "g", "peer", min_idle_time=0)[1]
    assert [entry_id for entry_id, _ in claimed] == ids[:1]


def test_a_fully_acknowledged_stream_is_emptied_and_the_trimmer_waits_its_interval(redis_client):
    _add(redis_client, 7)
    redis_client.xgroup_create(STREAM, "g", id="0")
    redis_client.xack(STREAM, "g", *_read(redis_client, "g", 7))
    trimmer = StreamTrimmer(redis_client, STREAM, interval_s=3600)
    trimmer.maybe_trim()  # not due yet
    assert len(_ids(redis_client)) == 7
    trimmer._next = 0.0
    trimmer.maybe_trim()
    assert _ids(redis_client) == [] and trimmer.trimmed == 7
