"""A worker's fenced commit run as one Lua script (bus/scripted_multi.py) keeps what WATCH and
MULTI promised: all of it or (fenced: its first write refused, or Redis full) none of it, a
failing command dropped without undoing the others, stream reads parsed as redis-py parses
them; and it costs fewer commands."""

from __future__ import annotations

import pytest
import redis

from bus.effects import execute_logging_errors
from bus.fenced_stream import CLOSED_LOG_ID
from bus.scripted_multi import ScriptedMulti


def _calls(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"]
            for name, stats in client.info("commandstats").items()}  # fmt: skip


def test_the_commands_run_in_order_and_reply_as_a_pipeline_would(redis_client):
    redis_client.xgroup_create("in", "g", id="0", mkstream=True)
    first = redis_client.xadd("in", {"m": b"\x00\xffjob"})
    pipe = ScriptedMulti(redis_client)
    pipe.xadd("out", {"m": b"a"})
    pipe.set("key", "v", ex=60)
    pipe.xreadgroup("g", "c", {"in": ">"}, count=10)
    pipe.xack("in", "g", first)
    pipe.xreadgroup("g", "c", {"in": ">"}, count=10)  # nothing new: None
    added, was_set, read, acked, nothing = pipe.execute()
    assert redis_client.xrange("out")[0][0] == added
    assert was_set == b"OK" and redis_client.ttl("key") > 0
    assert read == [[b"in", [(first, {b"m": b"\x00\xffjob"})]]]
    assert acked == 1 and nothing is None
    assert redis_client.xpending("in", "g")["pending"] == 0


def test_a_failing_command_is_dropped_and_the_others_still_run(redis_client):
    redis_client.hset("a-hash", "f", "v")  # a "reply stream" that is a hash
    pipe = ScriptedMulti(redis_client)
    pipe.xadd("a-hash", {"m": b"x"})
    pipe.xadd("fine", {"m": b"y"})
    results = execute_logging_errors(pipe, "test")
    assert isinstance(results[0], redis.ResponseError) and "WRONGTYPE" in str(results[0])
    assert redis_client.xlen("fine") == 1
    pipe = ScriptedMulti(redis_client)  # a pipeline's default: the first error raised
    pipe.xadd("a-hash", {"m": b"x"})
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        pipe.execute()


def _guarded_commit(client: redis.Redis, payload: bytes) -> list:
    pipe = ScriptedMulti(client, guarded=True)
    pipe.xadd("log", {"m": payload}, nomkstream=True)  # the fence: it must write
    pipe.xadd("out", {"m": payload})
    return pipe.execute()


@pytest.mark.parametrize("fence", ["closed", "deleted"])
def test_a_guard_that_writes_nothing_fences_the_whole_call(redis_client, fence):
    redis_client.xadd("log", {"m": b"opened"})
    logged, added = _guarded_commit(redis_client, b"a")
    assert redis_client.xrange("log")[-1][0] == logged and isinstance(added, bytes)
    if fence == "closed":  # as the reaper closes a worker's log (XSETID to the last id)
        redis_client.execute_command("XSETID", "log", CLOSED_LOG_ID)
    else:  # as the reaper deletes a gone worker's log
        redis_client.delete("log")
    with pytest.raises(redis.WatchError):
        _guarded_commit(redis_client, b"b")
    assert redis_client.xlen("out") == 1
    assert redis_client.xlen("log") == (2 if fence == "closed" else 0)  # nothing added


def test_a_full_redis_refuses_the_whole_commit(redis_client):
    pipe = ScriptedMulti(redis_client)
    pipe.xadd("out", {"m": b"a"})
    pipe.xadd("other", {"m": b"b"})
    redis_client.config_set("maxmemory", "1")
    try:
        with pytest.raises(redis.OutOfMemoryError):
            execute_logging_errors(pipe, "test")
    finally:
        redis_client.config_set("maxmemory", "1gb")
    assert not redis_client.exists("out", "other")


def test_a_restarted_server_gets_the_script_again(redis_client):
    ScriptedMulti(redis_client).xadd("out", {"m": b"a"}).execute()
    redis_client.script_flush()  # as a restart or a failover forgets it
    pipe = ScriptedMulti(redis_client)
    pipe.xadd("out", {"m": b"b"})
    pipe.execute()
    assert redis_client.xlen("out") == 2


def test_a_fenced_commit_costs_one_call_and_its_commands(redis_client):
    redis_client.xadd("log", {"m": b"opened"})
    redis_client.config_resetstat()
    _guarded_commit(redis_client, b"p")
    calls = _calls(redis_client)
    calls.pop("config|resetstat", None)
    # A MULTI under WATCH sent WATCH, GET, MULTI, 2 XADD and EXEC: six; the script with a
    # fence key, its GET too: four.
    assert calls == {"evalsha": 1, "xadd": 2}


def test_on_a_cluster_node_that_does_not_own_the_names_it_is_moved(nodes):
    # Every name of one shard shares a hash tag; "{a}" hashes to the third primary's slots.
    for url in nodes:
        client = redis.Redis.from_url(url)
        pipe = ScriptedMulti(client)
        pipe.xadd("p:{a}:out", {"m": b"a"})
        pipe.xadd("p:{a}:dead", {"m": b"b"})
        if url == nodes[2]:
            pipe.execute()
            assert client.xlen("p:{a}:out") == client.xlen("p:{a}:dead") == 1
        else:
            with pytest.raises(redis.exceptions.MovedError):
                pipe.execute()
        client.close()
