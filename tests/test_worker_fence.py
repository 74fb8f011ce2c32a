"""A worker's progress log is its fence (bus/fenced_stream.py), on a real server: every commit
writes its entry there first, a log the reaper closed or deleted refuses it and the whole
commit writes nothing, the worker opens it again and writes on; and the fence costs no
command of its own (issue 27: the GET of a fence key had been one per publish)."""

from __future__ import annotations

import pytest
import redis

from bus.effects import Outbound
from bus.fence_off import fence_off, read_progress_log
from bus.fenced_stream import WORKER_GROUP, Fenced, FencedStream
from jobs.progress import ProgressEntry
from jobs.protocol import ENTRY_FIELD, Abort, TokenizedRequest, encode
from runtime.config import BusConfig


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url)


def _calls(client: redis.Redis) -> dict[str, int]:
    calls = {name.removeprefix("cmdstat_"): stats["calls"]
             for name, stats in client.info("commandstats").items()}  # fmt: skip
    calls.pop("config|resetstat", None)
    return calls


def _opened(client: redis.Redis, config: BusConfig, worker_id: str = "w1") -> FencedStream:
    bus = FencedStream(client, config, worker_id)
    assert bus.open() == []
    return bus


def _publish(bus: FencedStream, config: BusConfig, what: str, log: bool = True) -> None:
    """Queue an output (an entry on a stream of our own) and, with `log`, a progress entry."""
    bus.outbox.append(Outbound("out", Abort(what)))
    if log:
        bus.progress = encode(ProgressEntry(bus.worker_id, slots=[[0, 0, b"\x01\x00", what]]))


def _claim(client: redis.Redis, config: BusConfig, worker_id: str = "w1") -> None:
    """The reaper's claim of whatever is pending to the worker, which closes its log."""
    fence_off(client, config, worker_id, "router-test", 256)


def test_a_commit_costs_its_script_call_and_its_writes_and_no_command_for_the_fence(
    redis_client, config
):
    bus = _opened(redis_client, config)
    _publish(bus, config, "r0")
    bus.commit(read=True)  # the server loads the script once
    _publish(bus, config, "r1")
    redis_client.config_resetstat()
    bus.commit(read=True)
    # The log's entry, the output, and the read of new jobs inside one EVALSHA: no GET.
    assert _calls(redis_client) == {"evalsha": 1, "xadd": 2, "xreadgroup": 1}
    assert bus.progress_written == redis_client.xrange(bus.progress_stream)[-1][0]


@pytest.mark.parametrize("log", [True, False])
def test_a_closed_log_fences_every_commit_until_the_worker_opens_it_again(
    redis_client, config, log
):
    bus = _opened(redis_client, config)
    _publish(bus, config, "before", log)
    bus.commit(read=False)
    logged = redis_client.xlen(bus.progress_stream)
    _claim(redis_client, config)
    _publish(bus, config, "after the claim", log)  # with nothing to log, its empty entry
    with pytest.raises(Fenced):
        bus.commit(read=True)
    assert redis_client.xlen("out") == 1  # nothing of the fenced commit was written
    assert redis_client.xlen(bus.progress_stream) == logged
    assert bus.restart_fenced() == []
    _publish(bus, config, "reopened", log)
    bus.commit(read=False)
    assert redis_client.xlen("out") == 2
    # The log kept its history through the close and the reopening, in order.
    entries = read_progress_log(redis_client, config, "w1")
    assert [e.slots[0][3] for e in entries if e.slots] == (["before", "reopened"] if log else [])


def test_a_deleted_log_fences_the_worker_and_opening_it_makes_it_again(redis_client, config):
    """The reaper forgets a worker it took for dead by deleting its stream and its log: a
    worker still alive must not make the log again by writing to it."""
    bus = _opened(redis_client, config)
    redis_client.delete(bus.progress_stream, bus.stream)
    _publish(bus, config, "r1")
    with pytest.raises(Fenced):
        bus.commit(read=False)
    assert not redis_client.exists(bus.progress_stream, "out")
    bus.restart_fenced()
    _publish(bus, config, "r1")
    bus.commit(read=False)
    assert redis_client.xlen("out") == 1


def test_a_new_life_under_the_id_reopens_the_log_its_last_life_left_closed(redis_client, config):
    first = _opened(redis_client, config)
    _publish(first, config, "r1")
    first.commit(read=False)
    _claim(redis_client, config)
    redis_client.xtrim(first.progress_stream, maxlen=0, approximate=False)  # emptied too
    second = _opened(redis_client, config)
    _publish(second, config, "r2")
    second.commit(read=False)
    assert redis_client.xlen("out") == 2
    assert [e.slots[0][3] for e in read_progress_log(redis_client, config, "w1") if e.slots] == [
        "r2"
    ]


def test_the_reaper_claims_off_a_worker_that_never_opened_its_log(redis_client, config):
    stream = config.worker_stream("w9")
    job = TokenizedRequest("r1", "t:reply", [1, 2, 3], {"max_new_tokens": 4})
    redis_client.xgroup_create(stream, WORKER_GROUP, id="0", mkstream=True)
    redis_client.xadd(stream, {ENTRY_FIELD: encode(job)})
    redis_client.xreadgroup(WORKER_GROUP, "w9-consumer", {stream: ">"}, count=1)
    entries, deliveries = fence_off(redis_client, config, "w9", "router-test", 256)
    assert len(entries) == 1 and deliveries == {entries[0][0]: 1}
    assert not redis_client.exists(config.progress_stream("w9"))


def test_a_stream_never_opened_opens_its_log_at_its_first_commit(redis_client, config):
    bus = FencedStream(redis_client, config, "w2")  # as a worker driven step by step
    _publish(bus, config, "r1")
    bus.commit(read=False)
    assert redis_client.xlen("out") == 1
    assert redis_client.xlen(bus.progress_stream) == 2  # the opening entry, then the commit's
