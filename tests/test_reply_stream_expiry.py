"""A bundled reply stream's expiry is renewed once a quarter TTL per detokenizer replica, not
per batch (stages/detokenizer/stream_expiries.py): through a real Actor on a real server, and
at the stage's own level for a turn that was not committed."""

from __future__ import annotations

import threading
import time

import pytest

from bus.actor import Actor, Inbound
from bus.effects import ExpireKey, Outbound
from bus.reconnect import ensure_group
from jobs.protocol import ENTRY_FIELD, TokenBatch, TokenItem, encode
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage

REPLY = "t:reply:ingress"
DIRECT = "t:reply:direct"


def _item(rid: str, start: int, reply_to: str = REPLY, bundle: bool = True) -> TokenItem:
    return TokenItem(rid, reply_to, start, [7], [], 0, bundle=bundle)


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, reply_ttl_s=2)  # renewals every 0.5 s


def _publish(client, config: BusConfig, *items: TokenItem) -> None:
    client.xadd(config.tokens_stream(), {ENTRY_FIELD: encode(TokenBatch("w", 1, list(items)))})


def _detokenizer(client, config: BusConfig) -> Actor:
    stage = DetokenizerStage(config, None)
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage)


def _expires(client) -> int:
    return client.info("commandstats").get("cmdstat_expire", {}).get("calls", 0)


def test_a_busy_bundled_stream_is_renewed_once_a_quarter_ttl_not_per_batch(redis_client, config):
    actor = _detokenizer(redis_client, config)
    redis_client.config_resetstat()
    for start in range(5):  # five batches of one busy stream within the first quarter TTL
        _publish(redis_client, config, _item("a", start))
        assert actor.run_once() == 1
    assert redis_client.xlen(REPLY) == 5
    assert 0 < redis_client.ttl(REPLY) <= config.reply_ttl_s  # the first write set it
    assert _expires(redis_client) == 1
    time.sleep(config.reply_ttl_s / 4 + 0.05)  # a quarter TTL later: due again
    _publish(redis_client, config, _item("a", 5))
    actor.run_once()
    assert _expires(redis_client) == 2


def test_a_deleted_stream_is_not_made_again_without_an_expiry(redis_client, config):
    actor = _detokenizer(redis_client, config)
    _publish(redis_client, config, _item("a", 0))
    actor.run_once()
    redis_client.delete(REPLY)  # its reader closed; a late delta follows
    _publish(redis_client, config, _item("a", 1))
    actor.run_once()
    assert not redis_client.exists(REPLY)
    time.sleep(config.reply_ttl_s / 4 + 0.05)  # once due, a write makes it, with its expiry
    _publish(redis_client, config, _item("a", 2))
    actor.run_once()
    assert 0 < redis_client.ttl(REPLY) <= config.reply_ttl_s


def test_a_direct_jobs_stream_is_renewed_with_every_batch(redis_client, config):
    actor = _detokenizer(redis_client, config)
    redis_client.config_resetstat()
    for start in range(3):  # its reader may delete the stream and use the name again
        _publish(redis_client, config, _item("d", start, DIRECT, bundle=False))
        actor.run_once()
        redis_client.delete(DIRECT)
    _publish(redis_client, config, _item("d", 3, DIRECT, bundle=False))
    actor.run_once()
    assert redis_client.xlen(DIRECT) == 1 and 0 < redis_client.ttl(DIRECT)
    assert _expires(redis_client) == 4


def test_a_renewal_counts_only_once_its_batch_is_committed():
    stage = DetokenizerStage(BusConfig(reply_ttl_s=3600), None)

    def handle(start: int) -> list:
        return stage.handle([Inbound(b"1-0", TokenBatch("w", 1, [_item("a", start)]))])

    first = handle(0)
    assert [o.key for o in first if isinstance(o, ExpireKey)] == [REPLY]
    again = handle(0)  # the turn was refused (an outage, OOM): handled again, renewed again
    assert [o.key for o in again if isinstance(o, ExpireKey)] == [REPLY]
    assert all(o.create for o in again if isinstance(o, Outbound))
    stage.committed()
    later = handle(1)
    assert not [o for o in later if isinstance(o, ExpireKey)]
    assert [o.create for o in later if isinstance(o, Outbound)] == [False]


def test_after_redis_comes_back_empty_the_streams_are_made_again(redis_client, config):
    actor = _detokenizer(redis_client, config)
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    try:
        _publish(redis_client, config, _item("a", 0))
        _wait(lambda: redis_client.exists(REPLY))
        redis_client.flushall()  # as a restart without persistence: the group goes too
        _publish(redis_client, config, _item("b", 0))  # a new request's first delta
        _wait(lambda: redis_client.exists(REPLY))
        assert 0 < redis_client.ttl(REPLY) <= config.reply_ttl_s
    finally:
        actor.stop.set()
        thread.join(timeout=10)


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
