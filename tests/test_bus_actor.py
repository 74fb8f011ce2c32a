"""The actor runtime against a real Redis-protocol server: batched reads, outputs and acks in
one MULTI, consumer groups shared by replicas, dead letters, and takeover of stale entries."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from bus.actor import Actor, Inbound, unique_consumer_name
from bus.effects import IncrHash, Outbound, Output, SetKey
from bus.reconnect import ReconnectingLoop, ensure_group
from jobs.protocol import (
    ENTRY_FIELD,
    Abort,
    ErrorReply,
    Message,
    TextDelta,
    TokenizedRequest,
    decode,
    encode,
)
from runtime.config import BusConfig

REPLY = "t:reply"


class EchoStage:
    """Turns each TokenizedRequest into a TextDelta of its ids on its reply_to.

    A rid starting with ``boom`` makes `handle` raise, as a stage bug would.
    """

    group = "echo"
    accepts = (TokenizedRequest,)

    def __init__(self) -> None:
        self.calls: list[list[str]] = []  # the rids of every handle() call
        self.handled: list[str] = []  # rids turned into output

    def input_stream(self, config: BusConfig) -> str:
        return f"{config.stream_prefix}:echo-in"

    def handle(self, batch: list[Inbound]) -> list[Output]:
        self.calls.append([inbound.message.rid for inbound in batch])
        outputs: list[Output] = []
        for inbound in batch:
            job = inbound.message
            if job.rid.startswith("boom"):
                raise ValueError(f"cannot echo {job.rid}")
            outputs.extend(self.outputs_for(job))
        self.handled.extend(inbound.message.rid for inbound in batch)
        return outputs

    def outputs_for(self, job: TokenizedRequest) -> list[Output]:
        return [Outbound(job.reply_to, TextDelta(job.rid, 0, job.input_ids, "echo"))]


class SimulatedCrash(BaseException):
    """What a process death looks like from inside handle(): nothing after it runs."""


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, claim_idle_ms=100, max_deliveries=2)


def _actor(client: redis.Redis, config: BusConfig, stage: EchoStage) -> Actor:
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage)


def _submit(
    client: redis.Redis, config: BusConfig, rid: str, reply_to: str = REPLY, ids=(1, 2, 3)
) -> bytes:
    job = TokenizedRequest(rid, reply_to, list(ids))
    return client.xadd(EchoStage().input_stream(config), {ENTRY_FIELD: encode(job)})


def _replies(client: redis.Redis, stream: str = REPLY) -> list[Message]:
    return [
        decode(fields[ENTRY_FIELD], TextDelta, ErrorReply) for _, fields in client.xrange(stream)
    ]


def _pending(client: redis.Redis, config: BusConfig, group: str = EchoStage.group) -> int:
    return client.xpending(EchoStage().input_stream(config), group)["pending"]


def _dead_letters(client: redis.Redis, config: BusConfig) -> list[dict[str, bytes]]:
    return [
        {key.decode(): value for key, value in fields.items()}
        for _, fields in client.xrange(config.dead_letter_stream())
    ]


def test_a_batch_of_entries_is_read_and_handled_in_one_turn(redis_client, config):
    stage = EchoStage()
    actor = _actor(redis_client, config, stage)
    rids = [f"r{i}" for i in range(5)]
    for rid in rids:
        _submit(redis_client, config, rid)
    assert actor.run_once() == 5
    assert stage.calls == [rids]
    assert actor.processed == 5


def test_read_count_bounds_a_batch(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, block_ms=20, read_count=3)
    stage = EchoStage()
    actor = _actor(redis_client, config, stage)
    for i in range(7):
        _submit(redis_client, config, f"r{i}")
    assert [actor.run_once() for _ in range(3)] == [3, 3, 1]
    assert [len(call) for call in stage.calls] == [3, 3, 1]


def test_outputs_are_written_and_inputs_acked_in_the_same_turn(redis_client, config):
    actor = _actor(redis_client, config, EchoStage())
    _submit(redis_client, config, "a", ids=(4, 5))
    _submit(redis_client, config, "b", reply_to="t:other-reply", ids=(6,))
    actor.run_once()
    assert _pending(redis_client, config) == 0
    assert _replies(redis_client) == [TextDelta("a", 0, [4, 5], "echo")]
    assert _replies(redis_client, "t:other-reply") == [TextDelta("b", 0, [6], "echo")]
    assert _dead_letters(redis_client, config) == []


def test_a_crash_inside_handle_writes_nothing_and_leaves_the_batch_pending(redis_client, config):
    class CrashingStage(EchoStage):
        def outputs_for(self, job):
            raise SimulatedCrash

    crashed = _actor(redis_client, config, CrashingStage())
    _submit(redis_client, config, "a")
    _submit(redis_client, config, "b")
    with pytest.raises(SimulatedCrash):
        crashed.run_once()
    assert _replies(redis_client) == []
    assert _pending(redis_client, config) == 2

    # A replica takes the batch over once it has been idle long enough.
    time.sleep(config.claim_idle_ms / 1000 + 0.05)
    survivor_stage = EchoStage()
    survivor = _actor(redis_client, config, survivor_stage)
    assert survivor.run_once() == 2
    assert survivor_stage.handled == ["a", "b"]
    assert [reply.rid for reply in _replies(redis_client)] == ["a", "b"]
    assert _pending(redis_client, config) == 0


def test_group_creation_is_idempotent_and_serves_entries_written_before_it(redis_client, config):
    stage = EchoStage()
    stream = stage.input_stream(config)
    for rid in ("early-1", "early-2"):
        _submit(redis_client, config, rid)
    for _ in range(3):  # replicas starting together all try to create the group
        ensure_group(redis_client, stream, stage.group)
    assert [g["name"] for g in redis_client.xinfo_groups(stream)] == [stage.group.encode()]
    actor = Actor(redis_client, config, stage)
    assert actor.run_once() == 2
    assert stage.handled == ["early-1", "early-2"]


def test_ensure_group_creates_the_stream_when_missing(redis_client, config):
    ensure_group(redis_client, "t:fresh", "g")
    assert redis_client.exists("t:fresh") == 1
    assert redis_client.xinfo_groups("t:fresh")[0]["name"] == b"g"


def test_ensure_group_raises_errors_other_than_busygroup(redis_client):
    redis_client.set("t:not-a-stream", "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        ensure_group(redis_client, "t:not-a-stream", "g")


def test_consumer_names_are_unique_per_replica():
    names = {unique_consumer_name("echo") for _ in range(50)}
    assert len(names) == 50
    assert all(name.startswith("echo-") for name in names)


def test_two_actors_on_one_group_split_the_entries_and_handle_each_once(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, block_ms=20, read_count=2)
    first, second = EchoStage(), EchoStage()
    actors = [_actor(redis_client, config, first), _actor(redis_client, config, second)]
    assert actors[0].consumer != actors[1].consumer
    rids = [f"r{i}" for i in range(9)]
    for rid in rids:
        _submit(redis_client, config, rid)
    rounds = 0
    while len(first.handled) + len(second.handled) < len(rids) and rounds < 10:
        for actor in actors:
            actor.run_once()
        rounds += 1
    assert first.handled and second.handled
    assert sorted(first.handled + second.handled) == sorted(rids)
    assert sorted(reply.rid for reply in _replies(redis_client)) == sorted(rids)
    assert _pending(redis_client, config) == 0


def test_malformed_entries_are_dead_lettered_and_the_rest_of_the_batch_is_handled(
    redis_client, config
):
    stage = EchoStage()
    actor = _actor(redis_client, config, stage)
    stream = stage.input_stream(config)
    _submit(redis_client, config, "good-1")
    garbage = redis_client.xadd(stream, {ENTRY_FIELD: b"\xc1 not msgpack"})
    wrong_kind = redis_client.xadd(stream, {ENTRY_FIELD: encode(Abort("x"))})
    no_field = redis_client.xadd(stream, {"other": "value"})
    _submit(redis_client, config, "good-2")

    assert actor.run_once() == 5
    assert stage.handled == ["good-1", "good-2"]
    assert [reply.rid for reply in _replies(redis_client)] == ["good-1", "good-2"]
    assert _pending(redis_client, config) == 0
    assert actor.dead_lettered == 3
    dead = _dead_letters(redis_client, config)
    assert [d["entry_id"] for d in dead] == [garbage, wrong_kind, no_field]
    assert {d["source"] for d in dead} == {stream.encode()}
    assert [d["payload"] for d in dead] == [b"\xc1 not msgpack", encode(Abort("x")), b""]
    reasons = [d["reason"].decode() for d in dead]
    assert reasons[0].startswith("not msgpack")
    assert "unexpected message kind 'abort'" in reasons[1]
    assert "no 'm' field" in reasons[2]


def test_an_entry_that_makes_the_stage_raise_is_dead_lettered_and_its_requester_told(
    redis_client, config
):
    stage = EchoStage()
    actor = _actor(redis_client, config, stage)
    _submit(redis_client, config, "ok-1")
    bad = _submit(redis_client, config, "boom-1", reply_to="t:boom-reply")
    _submit(redis_client, config, "ok-2")

    assert actor.run_once() == 3
    assert stage.handled == ["ok-1", "ok-2"]
    assert [reply.rid for reply in _replies(redis_client)] == ["ok-1", "ok-2"]
    (error,) = _replies(redis_client, "t:boom-reply")
    assert isinstance(error, ErrorReply)
    assert (error.rid, error.status, error.type) == ("boom-1", 500, "internal_error")
    assert "ValueError" not in error.message  # the client is not shown our internals
    (dead,) = _dead_letters(redis_client, config)
    assert dead["entry_id"] == bad
    assert "ValueError: cannot echo boom-1" in dead["reason"].decode()
    assert decode(dead["payload"], TokenizedRequest).rid == "boom-1"
    assert _pending(redis_client, config) == 0


def test_an_entry_left_pending_by_a_dead_consumer_is_claimed_once_idle(redis_client, config):
    stage = EchoStage()
    actor = _actor(redis_client, config, stage)
    stream = stage.input_stream(config)
    _submit(redis_client, config, "orphan")
    redis_client.xreadgroup(stage.group, "dead-consumer", {stream: ">"}, count=10)

    assert actor.run_once() == 0  # not idle for claim_idle_ms yet: it stays with its owner
    (entry,) = redis_client.xpending_range(stream, stage.group, min="-", max="+", count=10)
    assert entry["consumer"] == b"dead-consumer"

    time.sleep(config.claim_idle_ms / 1000 + 0.05)
    # Its second delivery: within max_deliveries (2), so it is handled.
    assert actor.run_once() == 1
    assert stage.handled == ["orphan"]
    assert [reply.rid for reply in _replies(redis_client)] == ["orphan"]
    assert _pending(redis_client, config) == 0
    assert _dead_letters(redis_client, config) == []


def test_an_entry_delivered_more_than_max_deliveries_times_is_dead_lettered(redis_client, config):
    stage = EchoStage()
    actor = _actor(redis_client, config, stage)
    stream = stage.input_stream(config)
    entry_id = _submit(redis_client, config, "poison")
    redis_client.xreadgroup(stage.group, "dead-1", {stream: ">"}, count=10)
    redis_client.xclaim(stream, stage.group, "dead-2", 0, [entry_id])  # second delivery

    time.sleep(config.claim_idle_ms / 1000 + 0.05)
    actor.run_once()  # the third delivery, past max_deliveries=2
    assert stage.calls == []
    (answer,) = _replies(redis_client)  # its requester is told, not left waiting
    assert (answer.rid, answer.status, answer.type) == ("poison", 500, "internal_error")
    assert _pending(redis_client, config) == 0
    (dead,) = _dead_letters(redis_client, config)
    assert dead["entry_id"] == entry_id
    assert dead["source"] == stream.encode()
    assert dead["reason"] == b"delivered 3 times without being handled"
    assert decode(dead["payload"], TokenizedRequest).rid == "poison"
    assert actor.dead_lettered == 1


def test_set_key_incr_hash_and_reply_expiry_are_applied_with_the_outputs(redis_client, config):
    class BookkeepingStage(EchoStage):
        def outputs_for(self, job):
            return [
                Outbound(job.reply_to, TextDelta(job.rid, 0, job.input_ids), expire_s=30),
                SetKey(f"t:route:{job.rid}", f"worker-of-{job.rid}", ttl_s=60),
                IncrHash("t:counts", "jobs", 2),
            ]

    actor = _actor(redis_client, config, BookkeepingStage())
    for rid in ("a", "b", "c"):
        _submit(redis_client, config, rid)
    actor.run_once()
    assert redis_client.get("t:route:b") == b"worker-of-b"
    assert 0 < redis_client.ttl("t:route:b") <= 60
    assert redis_client.hget("t:counts", "jobs") == b"6"
    assert 0 < redis_client.ttl(REPLY) <= 30
    assert len(_replies(redis_client)) == 3


def test_run_serves_entries_and_stops_promptly_when_stop_is_set(redis_client, config):
    stage = EchoStage()
    actor = Actor(redis_client, config, stage)  # run() creates the group itself
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    _submit(redis_client, config, "live")
    reply = redis_client.xread({REPLY: "0"}, block=2000, count=1)
    assert reply and decode(reply[0][1][0][1][ENTRY_FIELD], TextDelta).rid == "live"

    started = time.monotonic()
    actor.stop.set()
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert time.monotonic() - started < 0.5


def test_replicas_started_together_share_one_group_and_serve_every_entry(redis_client, config):
    stages = [EchoStage() for _ in range(3)]
    stop = threading.Event()
    actors = [Actor(redis_client, config, stage, stop) for stage in stages]
    threads = [threading.Thread(target=actor.run, daemon=True) for actor in actors]
    for thread in threads:
        thread.start()
    rids = [f"r{i}" for i in range(12)]
    for rid in rids:
        _submit(redis_client, config, rid)
    deadline = time.monotonic() + 3
    while len(_replies(redis_client)) < len(rids) and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    for thread in threads:
        thread.join(timeout=2)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(rid for stage in stages for rid in stage.handled) == sorted(rids)
    stream = stages[0].input_stream(config)
    assert len(redis_client.xinfo_groups(stream)) == 1


def test_a_reply_to_naming_a_non_stream_key_does_not_kill_the_actor(redis_client, config):
    stage = EchoStage()
    actor = _actor(redis_client, config, stage)
    redis_client.hset("t:a-hash", "field", 1)
    _submit(redis_client, config, "misdirected", reply_to="t:a-hash")
    _submit(redis_client, config, "fine")
    actor.run_once()
    assert [reply.rid for reply in _replies(redis_client)] == ["fine"]
    assert _pending(redis_client, config) == 0


def test_a_reply_stream_holding_a_500_expires_after_reply_ttl(redis_client, config):
    actor = _actor(redis_client, config, EchoStage())
    _submit(redis_client, config, "boom", reply_to="t:lonely-reply")
    actor.run_once()
    (reply,) = _replies(redis_client, "t:lonely-reply")
    assert isinstance(reply, ErrorReply) and reply.status == 500
    assert 0 < redis_client.ttl("t:lonely-reply") <= config.reply_ttl_s


def test_a_group_missing_again_as_soon_as_made_is_retried_with_backoff(redis_client):
    # NOGROUP for a group the loop does not make (another stream's): remade at once the
    # first time, as after a restart, then at the reconnect backoff's pace, not in a spin.
    made: list[float] = []
    stop = threading.Event()
    loop = ReconnectingLoop("t", stop, lambda: made.append(time.monotonic()))
    runner = threading.Thread(target=loop.run, args=(lambda: redis_client.xpending("gone", "g"),))
    runner.start()
    time.sleep(1.0)
    stop.set()
    runner.join(timeout=5)
    assert not runner.is_alive()
    assert 3 <= len(made) <= 6  # at 0 (the first turn's), 0, 0.1, 0.3, 0.8 s
