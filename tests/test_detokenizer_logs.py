"""A worker publishes its token batches in its progress log, one entry a commit that is also
its fence (bus/fenced_stream.py), and the detokenizers read them off every worker's log in
the same XREADGROUP (bus/extra_inputs.py): on a real server, with real workers' fenced
streams and a real detokenizer Actor and reaper."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

import jobs.protocol as wire
from bus.actor import Actor
from bus.effects import Outbound
from bus.extra_inputs import REFRESH_S
from bus.fenced_stream import LOG_READERS_GROUP, FencedStream
from bus.reconnect import ReconnectingLoop, ensure_group
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage
from stages.router.worker_reaper import WorkerReaper

REPLY = "t:reply:ingress"


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, claim_idle_ms=60_000)


def _worker(client, config: BusConfig, worker_id: str, register: bool = True) -> FencedStream:
    """A worker's fenced stream with its log open, then registered (as a worker starts: its
    first heartbeat follows the opening)."""
    bus = FencedStream(client, config, worker_id)
    bus.open()
    if register:
        client.sadd(config.workers_key(), worker_id)
    return bus


def _publish(bus: FencedStream, rid: str, start: int, ids: list[int]) -> None:
    """One commit carrying one item of `rid`'s tokens (as gpu_worker/publishing.py queues it)."""
    item = wire.TokenItem(rid, REPLY, start, ids, [], 0, bundle=True)
    batch = wire.TokenBatch(bus.worker_id, 1, [item])
    bus.outbox.append(Outbound(bus.config.tokens_stream(), batch))
    bus.commit(read=False)


def _detokenizer(client, config: BusConfig) -> Actor:
    stage = DetokenizerStage(config, None)
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage)


def _delivered(client) -> dict[str, list[int]]:
    """rid -> the ids its reply stream received, in order."""
    ids: dict[str, list[int]] = {}
    for _, fields in client.xrange(REPLY):
        message = wire.decode(fields[wire.ENTRY_FIELD], wire.TextDeltas, wire.TextDelta)
        for delta in message.deltas if isinstance(message, wire.TextDeltas) else [message]:
            ids.setdefault(delta.rid, []).extend(delta.ids)
    return ids


def _drain(actor: Actor, turns: int = 6) -> None:
    for _ in range(turns):
        actor.run_once()


def test_a_publish_is_one_xadd_to_the_log_and_the_detokenizer_reads_it(redis_client, config):
    bus = _worker(redis_client, config, "w1")
    actor = _detokenizer(redis_client, config)
    _publish(bus, "a", 0, [10])  # (the first also loads the script)
    redis_client.config_resetstat()
    for start in (1, 2):
        _publish(bus, "a", start, [10 + start])
    stats = redis_client.info("commandstats")
    # Nothing to write but the log's entry: its XADD alone, no script, no tokens stream.
    assert "cmdstat_evalsha" not in stats
    assert stats["cmdstat_xadd"]["calls"] == 2
    log = config.progress_stream("w1")
    entries = redis_client.xrange(log)
    assert [wire.decode(f[wire.TOKENS_FIELD], wire.TokenBatch).items[0].ids for _, f in entries
            if wire.TOKENS_FIELD in f] == [[10], [11], [12]]  # fmt: skip
    # The tokens stream holds only the empty batch that said the log opened.
    assert [wire.decode(f[wire.ENTRY_FIELD], wire.TokenBatch).items for _, f in
            redis_client.xrange(config.tokens_stream())] == [[]]  # fmt: skip
    _drain(actor)
    assert _delivered(redis_client) == {"a": [10, 11, 12]}
    group = next(g for g in redis_client.xinfo_groups(log) if g["name"] == b"detokenizer")
    assert group["pending"] == 0 and group["lag"] == 0


def test_a_log_opened_while_the_detokenizer_runs_is_read_at_once(redis_client, config):
    actor = _detokenizer(redis_client, config)
    actor.run_once()  # started, reading: no worker yet
    # Says so on the tokens stream; its first heartbeat (the registration) has not come yet.
    bus = _worker(redis_client, config, "late", register=False)
    _publish(bus, "b", 0, [5, 6])
    started = time.monotonic()
    _drain(actor, turns=3)  # the word, then the log: well within the list's refresh
    assert _delivered(redis_client) == {"b": [5, 6]}
    assert time.monotonic() - started < REFRESH_S


def test_a_log_deleted_under_the_detokenizer_is_dropped_and_the_others_read_on(
    redis_client, config
):
    first, second = _worker(redis_client, config, "w1"), _worker(redis_client, config, "w2")
    actor = _detokenizer(redis_client, config)
    _publish(first, "a", 0, [1])
    _drain(actor)
    redis_client.delete(config.progress_stream("w1"))  # by hand: its group goes with it
    redis_client.srem(config.workers_key(), "w1")
    _publish(second, "b", 0, [2])
    _drain(actor)  # the read naming the gone log fails once; the list is made again
    assert _delivered(redis_client) == {"a": [1], "b": [2]}
    assert not redis_client.exists(config.progress_stream("w1"))  # never made again


def test_a_malformed_batch_in_a_log_is_dead_lettered_and_the_stage_reads_on(redis_client, config):
    bus = _worker(redis_client, config, "w1")
    actor = _detokenizer(redis_client, config)
    log = config.progress_stream("w1")
    redis_client.xadd(log, {wire.ENTRY_FIELD: b"", wire.TOKENS_FIELD: b"\xc1 not msgpack"})
    for named in ("no such:worker", "gone"):  # words naming no log, or none that exists
        word = wire.encode(wire.TokenBatch(named, 0, []))
        redis_client.xadd(config.tokens_stream(), {wire.ENTRY_FIELD: word})
    _publish(bus, "a", 0, [3])
    _drain(actor)
    assert _delivered(redis_client) == {"a": [3]}
    (_, dead), = redis_client.xrange(config.dead_letter_stream())  # fmt: skip
    assert dead[b"source"] == log.encode()
    group = next(g for g in redis_client.xinfo_groups(log) if g["name"] == b"detokenizer")
    assert group["pending"] == 0


def test_members_of_the_workers_set_no_worker_wrote_leave_the_detokenizer_reading(
    redis_client, config
):
    # It reads every registered worker's log: a member naming no key (not UTF-8, a ':')
    # once ended every detokenizer as it started, again and again.
    redis_client.sadd(config.workers_key(), b"\xff", b"a:b", b"")
    bus = _worker(redis_client, config, "w1")
    actor = _detokenizer(redis_client, config)
    _publish(bus, "a", 0, [4, 5])
    _drain(actor)
    assert _delivered(redis_client) == {"a": [4, 5]}


def test_the_worker_never_trims_its_log_past_what_the_detokenizers_have_not_read(
    redis_client, config
):
    bus = _worker(redis_client, config, "w1")
    log = config.progress_stream("w1")
    for start in range(3):
        _publish(bus, "a", start, [start])
    newest = redis_client.xrevrange(log, count=1)[0][0]
    bus.progress_trim = newest  # no job needs the entries below: only the readers do
    _publish(bus, "a", 3, [3])  # a commit, with its trim
    assert sum(wire.TOKENS_FIELD in f for _, f in redis_client.xrange(log)) == 4
    actor = _detokenizer(redis_client, config)
    _drain(actor)
    bus.progress_trim = redis_client.xrevrange(log, count=1)[0][0]
    _publish(bus, "a", 4, [4])
    assert redis_client.xlen(log) == 2  # the entry named, and the commit's own
    _drain(actor)
    assert _delivered(redis_client) == {"a": [0, 1, 2, 3, 4]}


def test_the_reaper_moves_a_dead_workers_unacknowledged_batches_to_the_tokens_stream(
    redis_client, config
):
    bus = _worker(redis_client, config, "dead")
    actor = _detokenizer(redis_client, config)
    _publish(bus, "a", 0, [1])
    _drain(actor)
    log = config.progress_stream("dead")
    _publish(bus, "a", 1, [2])
    # Delivered to a detokenizer that died with it (pending), and one never read.
    redis_client.xreadgroup(LOG_READERS_GROUP, "gone", {log: ">"})
    _publish(bus, "a", 2, [3])
    reaper = WorkerReaper(redis_client, config, "router-test", threading.Event())
    assert reaper.reap("dead")  # no heartbeat: forgotten, its log deleted
    assert not redis_client.exists(log)
    assert not redis_client.sismember(config.workers_key(), "dead")
    _drain(actor)
    assert _delivered(redis_client) == {"a": [1, 2, 3]}


def test_a_turn_redis_refused_then_lost_with_its_log_leaves_the_loop_serving(
    redis_client, config, caplog
):
    # The detokenizer read a worker's log, and Redis refused its commit (full, or going
    # down); then Redis came back empty, as one restarted without persistence does. The
    # entries it held went with the log: asking Redis about them again made each turn fail
    # the same way, a spin of thousands of turns a second until the worker wrote its log anew.
    bus = _worker(redis_client, config, "w1")
    actor = _detokenizer(redis_client, config)
    _drain(actor, turns=2)  # reading the log
    _publish(bus, "a", 0, [1])
    limit = redis_client.config_get("maxmemory")["maxmemory"]
    redis_client.config_set("maxmemory", 1)  # below what it uses: every write refused
    try:
        with pytest.raises(redis.OutOfMemoryError):
            actor.run_once()
    finally:
        redis_client.config_set("maxmemory", limit)
    redis_client.flushall()  # the restart: no stream, group or key left
    loop = ReconnectingLoop("detokenizer", actor.stop, actor._ensure_group)
    runner = threading.Thread(target=loop.run, args=(actor.run_once,))
    with caplog.at_level(logging.WARNING, logger="bus.reconnect"):
        runner.start()
        time.sleep(0.5)
        bus.restart_fenced()  # the worker: its log opened again, where it goes on
        _publish(bus, "b", 0, [2])
        deadline = time.monotonic() + 5
        while "b" not in _delivered(redis_client) and time.monotonic() < deadline:
            time.sleep(0.02)
        actor.stop.set()
        runner.join(timeout=5)
    assert _delivered(redis_client) == {"b": [2]}
    assert len(caplog.records) <= 1, caplog.text
