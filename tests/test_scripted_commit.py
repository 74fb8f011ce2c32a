"""One commit as one script call (bus/scripted_commit.py), on a real server: the MULTI/EXEC
semantics it replaces (atomic, a failed command dropped alone, a full Redis refusing it whole,
nothing written past a moved fence), parsed replies as a pipeline's, and what it costs."""

from __future__ import annotations

import pytest
import redis

from bus.scripted_commit import MAX_SCRIPT_ARGS, FenceMoved, ScriptedCommit, fence_arg
from runtime.embedded_server import EmbeddedRedis


def _calls(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stat["calls"]
            for name, stat in client.info("commandstats").items()}  # fmt: skip


def test_the_queued_commands_run_in_one_call_and_answer_as_a_pipeline_would(redis_client):
    redis_client.xgroup_create("jobs", "g", id="0", mkstream=True)
    redis_client.xadd("jobs", {"job": "1"})
    commit = ScriptedCommit(redis_client)
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd("out", {"m": b"\x00\xff"}, maxlen=100, approximate=True)
    pipe.expire("out", 60)
    pipe.xreadgroup("g", "c", {"jobs": ">"}, count=10)
    pipe.xreadgroup("g", "c", {"jobs": ">"}, count=10)  # nothing new: None, as XREADGROUP's
    warm = redis_client.pipeline(transaction=False)
    warm.exists("out")
    commit.execute(warm, "test", key="out")  # the server learns the script (once a life)
    redis_client.config_resetstat()
    entry_id, expired, read, nothing = commit.execute(pipe, "test", key="out")
    assert isinstance(entry_id, bytes) and expired is True and nothing in (None, [])
    ((stream, entries),) = read
    assert stream == b"jobs" and entries[0][1] == {b"job": b"1"}
    assert redis_client.xrange("out")[0][1] == {b"m": b"\x00\xff"}
    calls = _calls(redis_client)
    assert "multi" not in calls and "exec" not in calls and "watch" not in calls
    assert calls["evalsha"] + calls.get("eval", 0) == 1 and calls["xadd"] == 1


def test_a_failed_command_is_dropped_alone_and_the_others_are_written(redis_client, caplog):
    redis_client.hset("not-a-stream", "a", 1)
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd("a", {"m": 1})
    pipe.xadd("not-a-stream", {"m": 1})  # WRONGTYPE
    pipe.xadd("b", {"m": 1})
    first, failed, last = ScriptedCommit(redis_client).execute(pipe, "test", key="a")
    assert isinstance(failed, redis.ResponseError) and "WRONGTYPE" in str(failed)
    assert redis_client.xlen("a") == 1 and redis_client.xlen("b") == 1
    assert "a write failed and was dropped" in caplog.text


def test_nothing_is_written_once_the_fence_moved(redis_client):
    commit = ScriptedCommit(redis_client)

    def write(fence: bytes | None) -> None:
        pipe = redis_client.pipeline(transaction=False)
        pipe.xadd("out", {"m": 1})
        commit.execute(pipe, "test", key="fence", fence=fence_arg(fence))

    write(None)  # no fence key yet, as expected: written
    redis_client.set("fence", b"t1")  # the reaper takes jobs off the worker
    with pytest.raises(FenceMoved):
        write(None)
    write(b"t1")  # the worker took the new fence
    redis_client.set("fence", b"t2")
    with pytest.raises(FenceMoved):
        write(b"t1")
    assert redis_client.xlen("out") == 2


def test_a_command_too_long_for_a_script_goes_by_multi_under_the_same_fence(redis_client):
    redis_client.xgroup_create("jobs", "g", id="0", mkstream=True)
    ids = [redis_client.xadd("jobs", {"j": i}) for i in range(MAX_SCRIPT_ARGS)]
    redis_client.xreadgroup("g", "c", {"jobs": ">"})
    redis_client.set("fence", b"t1")
    commit = ScriptedCommit(redis_client)
    pipe = redis_client.pipeline(transaction=False)
    pipe.xack("jobs", "g", *ids)
    with pytest.raises(FenceMoved):
        commit.execute(pipe, "test", key="fence", fence=fence_arg(b"t0"))
    pipe.xack("jobs", "g", *ids)
    assert commit.execute(pipe, "test", key="fence", fence=fence_arg(b"t1")) == [len(ids)]


def test_a_full_redis_refuses_the_whole_commit():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.set("ballast", b"x" * 2**20)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 2**19)
        pipe = client.pipeline(transaction=False)
        pipe.get("ballast")  # a read first: Redis refuses at the first write, none done
        pipe.xadd("out", {"m": 1})
        pipe.xadd("out2", {"m": 1})
        with pytest.raises(redis.OutOfMemoryError):
            ScriptedCommit(client).execute(pipe, "test", key="out")
        assert not client.exists("out") and not client.exists("out2")
        client.close()


def test_a_restarted_server_without_the_script_gets_it_again(redis_client):
    commit = ScriptedCommit(redis_client)
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd("out", {"m": 1})
    commit.execute(pipe, "test", key="out")
    redis_client.script_flush()  # as a restart without persistence of scripts does
    pipe.xadd("out", {"m": 2})
    commit.execute(pipe, "test", key="out")
    assert redis_client.xlen("out") == 2
