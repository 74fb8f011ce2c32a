"""A replayable stage (the detokenizer: its readers drop a delta they already have) writes its
outputs without a MULTI and acknowledges its inputs with its next read (bus/actor.py): two
commands a publish less, and still nothing lost when it dies between the two, nor when a full
Redis refuses its writes."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from bus.actor import Actor
from bus.reconnect import ensure_group
from bus.reply_order import ReplyOrderer
from jobs.protocol import ENTRY_FIELD, ErrorReply, TextDelta, TextDeltas, decode
from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis
from tests.test_bus_actor import REPLY, EchoStage, _replies, _submit
from tests.test_redis_memory import fill, free


class ReplayableEcho(EchoStage):
    replayable = True


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, claim_idle_ms=100, max_deliveries=3)


def _actor(client: redis.Redis, config: BusConfig) -> Actor:
    stage = ReplayableEcho()
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage)


def _pending(client: redis.Redis, config: BusConfig) -> int:
    return client.xpending(ReplayableEcho().input_stream(config), EchoStage.group)["pending"]


def _commands(client: redis.Redis) -> dict[str, int]:
    return {name: stats["calls"] for name, stats in client.info("commandstats").items()}


def test_its_outputs_go_without_multi_and_its_inputs_are_acked_with_the_next_read(
    redis_client, config
):
    actor = _actor(redis_client, config)
    for rid in ("a", "b"):
        _submit(redis_client, config, rid)
    redis_client.config_resetstat()
    assert actor.run_once() == 2
    written = _commands(redis_client)
    assert [m.rid for m in _replies(redis_client)] == ["a", "b"]
    assert _pending(redis_client, config) == 2  # written, not yet acknowledged
    assert "cmdstat_multi" not in written and "cmdstat_exec" not in written
    assert "cmdstat_xack" not in written
    redis_client.config_resetstat()
    assert actor.run_once() == 0  # the next read carries the acknowledgement
    acked = _commands(redis_client)
    assert _pending(redis_client, config) == 0
    assert acked.get("cmdstat_xack") == 1 and acked.get("cmdstat_xreadgroup") == 1


def test_a_replica_that_dies_before_acknowledging_has_its_batch_written_again_and_read_once(
    redis_client, config
):
    dying = _actor(redis_client, config)
    _submit(redis_client, config, "a", ids=(4, 5))
    dying.run_once()  # written; then the process dies holding the acknowledgement
    time.sleep(config.claim_idle_ms / 1000 + 0.05)
    heir = _actor(redis_client, config)
    assert heir.run_once() == 1  # claimed, and written a second time
    heir.run_once()
    assert _pending(redis_client, config) == 0
    copies = _replies(redis_client)
    assert copies == [TextDelta("a", 0, [4, 5], "echo")] * 2
    orderer = ReplyOrderer()  # what every reader of a reply stream orders deltas with
    released = [delta for copy in copies for delta in orderer.push(copy)]
    assert released == [TextDelta("a", 0, [4, 5], "echo")]


def test_a_stopped_replica_acknowledges_what_it_wrote(redis_client, config):
    actor = _actor(redis_client, config)
    _submit(redis_client, config, "a")
    assert actor.run_once() == 1
    assert _replies(redis_client) and _pending(redis_client, config) == 1  # held for a read
    actor.stop.set()  # stopped before that read: its exit acknowledges what it wrote
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert _pending(redis_client, config) == 0


def test_outputs_a_full_redis_refuses_are_not_acknowledged_and_go_out_once_it_is_freed():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        config = BusConfig(redis_url=server.url, block_ms=20, claim_idle_ms=100)
        actor = _actor(client, config)
        _submit(client, config, "a")
        fill(client)
        with pytest.raises(redis.OutOfMemoryError):
            actor.run_once()
        with pytest.raises(redis.OutOfMemoryError):  # retried by the replica holding it
            actor.run_once()
        assert _pending(client, config) == 1 and _replies(client) == []
        free(client)
        assert actor.run_once() == 1
        actor.run_once()
        assert [m.rid for m in _replies(client)] == ["a"]
        assert _pending(client, config) == 0
        client.close()


def test_the_detokenizer_is_replayable_and_its_bundles_decode_to_one_copy_each(
    redis_client, config
):
    """Through the real stage: a TokenBatch handled twice (a replica died before its
    acknowledgement) leaves two TextDeltas entries whose deltas a reader takes once."""
    from jobs.protocol import TokenBatch, TokenItem
    from stages.detokenizer.stage import DetokenizerStage

    stage = DetokenizerStage(config, None)
    assert stage.replayable
    batch = TokenBatch("w", 1, [TokenItem("r", REPLY, 0, [7, 8], [], bundle=True)])
    for _ in range(2):
        for output in stage.handle([_inbound(batch)]):
            pipe = redis_client.pipeline(transaction=False)
            output.apply(pipe, config)
            pipe.execute()
    entries = [decode(f[ENTRY_FIELD], TextDeltas, TextDelta, ErrorReply)
               for _, f in redis_client.xrange(REPLY)]  # fmt: skip
    assert len(entries) == 2
    orderer = ReplyOrderer()
    released = [d for entry in entries for delta in entry.deltas for d in orderer.push(delta)]
    assert [(d.rid, d.seq, d.ids) for d in released] == [("r", 0, [7, 8])]


def _inbound(message):
    from bus.actor import Inbound

    return Inbound(b"1-0", message)
