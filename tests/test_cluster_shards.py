"""The bus on a Redis Cluster, below the stages: detection, one shard per primary with its
own hash tag, every name of a shard in one slot, and `attach` choosing a shard (a
three-primary cluster of the embedded binary, tests/cluster_fixture.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis

from batch_store.batches import BatchStore
from batch_store.files import FileStore
from observability.metrics import index_key, snapshot_key
from runtime.cluster import (
    ClusterError,
    attach,
    cluster_primaries,
    is_cluster,
    is_slot_moved,
    key_slot,
    node_url_for,
    shard_configs,
    shard_tags,
)
from runtime.config import BusConfig
from tests.cluster_fixture import SLOT_RANGES
from tests.pipeline_harness import free_port

# Every name-making method of BusConfig: its arguments and its name without a shard (as
# every deployment before clusters named it).
NAMES = {
    "requests_stream": ((), "requests"), "tokenized_stream": ((), "tokenized"),
    "tokens_stream": ((), "tokens"), "worker_stream": (("w1",), "worker:w1"),
    "reply_stream": (("f1",), "reply:f1"), "dead_letter_stream": ((), "dead-letter"),
    "heartbeat_key": (("w1",), "heartbeat:w1"), "workers_key": ((), "workers"),
    "progress_stream": (("w1",), "progress:w1"), "reaping_key": (("w1",), "reaping:w1"),
    "legacy_fence_key": (("w1",), "fence:w1"), "routed_key": ((), "routed"),
    "request_key": (("q1",), "request:q1"),
    "frontend_key": (("f1",), "frontend:f1"), "abort_key": (("r1",), "abort:r1"),
}  # fmt: skip


def test_a_plain_server_is_not_a_cluster_and_a_cluster_node_is(redis_client, nodes):
    assert not is_cluster(redis_client)
    for url in nodes:
        with redis.Redis.from_url(url) as client:
            assert is_cluster(client)


def test_without_a_shard_names_are_as_before_and_with_one_all_share_one_slot():
    plain, sharded = BusConfig(), BusConfig(shard="s1")
    for method, (args, rest) in NAMES.items():
        assert getattr(plain, method)(*args) == f"streamserve:{rest}"
        assert getattr(sharded, method)(*args) == f"streamserve:{{s1}}:{rest}"
    slots = {key_slot(getattr(sharded, method)(*args)) for method, (args, _) in NAMES.items()}
    assert slots == {key_slot("{s1}")}
    assert BusConfig.from_env({"STREAMSERVE_SHARD": "s2"}).requests_stream() == (
        "streamserve:{s2}:requests"
    )


def test_names_built_outside_busconfig_carry_the_shard_too():
    sharded = BusConfig(shard="s1")
    files, batches = FileStore(None, sharded), BatchStore(None, sharded)
    names = [
        files.index, files.key("file-1"), files.owner_index("o"), files.owner_sizes("o"),
        batches.index, batches.active, batches.key("b1"), batches.key("b1", "lease"),
        batches.owner_index("o"), snapshot_key(sharded, "worker", "w1"), index_key(sharded),
    ]  # fmt: skip
    assert all(name.startswith("streamserve:{s1}:") for name in names), names
    assert batches.key("b1", "lease") == "streamserve:{s1}:batch:b1:lease"


@pytest.mark.parametrize("bad", ["", "a b", "a:b", "{s1", "s1}"])
def test_a_shard_that_would_break_its_hash_tag_is_refused(bad):
    with pytest.raises(ValueError, match="shard"):
        BusConfig(shard=bad)


def test_primaries_are_ordered_by_first_slot_whichever_node_is_asked(nodes):
    ports = {url: int(url.rsplit(":", 1)[1]) for url in nodes}
    for url in nodes:
        primaries = cluster_primaries(url)
        assert [ranges for _, ranges in primaries] == [[r] for r in SLOT_RANGES]
        assert [ports[u] for u, _ in primaries] == [ports[u] for u in nodes]


def test_each_shard_tag_hashes_into_its_own_primarys_slots(nodes):
    primaries = cluster_primaries(nodes[0])
    tags = shard_tags(primaries)
    assert len(set(tags)) == 3 and tags == shard_tags(primaries)  # deterministic
    for tag, (first, last) in zip(tags, SLOT_RANGES, strict=True):
        assert first <= key_slot(f"{{{tag}}}") <= last


def test_each_shard_config_writes_all_its_names_to_its_primary_in_one_multi(nodes):
    base = BusConfig(redis_url=nodes[2], stream_prefix="sp")
    shards = shard_configs(base)
    assert [s.redis_url for s in shards] == nodes
    assert [dataclasses.replace(s, redis_url=None, shard=None) for s in shards] == [
        dataclasses.replace(base, redis_url=None)
    ] * 3
    for shard in shards:
        with redis.Redis.from_url(shard.redis_url) as client:
            with client.pipeline(transaction=True) as multi:  # a MULTI over all its names
                for method, (args, _) in NAMES.items():
                    multi.set(getattr(shard, method)(*args), b"1")
                multi.execute()
            assert client.dbsize() == len(NAMES)


def test_on_a_plain_server_there_is_one_shard_the_config_itself(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url)
    assert shard_configs(config) == [config]
    assert attach(config, "worker") is config
    assert attach(config, "router") is config


def test_a_worker_attaches_to_the_shard_with_the_fewest_live_workers(nodes):
    shards = shard_configs(BusConfig(redis_url=nodes[1]))
    assert attach(BusConfig(redis_url=nodes[1]), "worker") == shards[0]  # a tie: the first
    _beat(shards[0], "a")
    _beat(shards[0], "b")
    _beat(shards[1], "c")
    _register_dead(shards[2], "gone")  # in the set, its heartbeat expired: not counted
    assert attach(BusConfig(redis_url=nodes[0]), "worker") == shards[2]
    _beat(shards[2], "d")
    _beat(shards[2], "e")
    assert attach(BusConfig(redis_url=nodes[0]), "worker") == shards[1]


def test_a_stage_attaches_to_the_shard_with_the_fewest_live_consumers_of_its_group(nodes):
    shards = shard_configs(BusConfig(redis_url=nodes[0]))
    for shard in shards[:2]:
        _read_as(shard, shard.tokenized_stream(), "router", "router-1")
    _read_as(shards[2], shards[2].requests_stream(), "tokenizer", "tokenizer-1")
    assert attach(BusConfig(redis_url=nodes[0]), "router") == shards[2]
    assert attach(BusConfig(redis_url=nodes[0]), "tokenizer") == shards[0]
    assert attach(BusConfig(redis_url=nodes[0]), "detokenizer") == shards[0]


def test_a_shard_named_in_the_environment_is_the_one_attached(nodes):
    shards = shard_configs(BusConfig(redis_url=nodes[0]))
    pinned = BusConfig.from_env({"REDIS_URL": nodes[0], "STREAMSERVE_SHARD": shards[2].shard})
    assert attach(pinned, "worker") == shards[2]
    with pytest.raises(ClusterError, match="STREAMSERVE_SHARD=nowhere"):
        attach(dataclasses.replace(pinned, shard="nowhere"), "worker")
    with pytest.raises(ValueError, match="unknown role"):
        attach(pinned, "ingress-ish")


def test_an_unreachable_server_is_waited_for_up_to_the_given_time():
    config = BusConfig(redis_url=f"redis://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        attach(config, "tokenizer", wait_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5


def test_a_name_of_another_shard_is_a_slot_moved_error_even_inside_a_multi(nodes):
    shards = shard_configs(BusConfig(redis_url=nodes[0]))
    with redis.Redis.from_url(nodes[0]) as client:
        with pytest.raises(redis.ResponseError) as single:
            client.set(shards[1].workers_key(), b"1")
        assert is_slot_moved(single.value)
        with pytest.raises(redis.ResponseError) as in_multi:
            with client.pipeline(transaction=True) as multi:
                multi.set(shards[0].workers_key(), b"1")
                multi.set(shards[2].workers_key(), b"1")
                multi.execute()
        assert is_slot_moved(in_multi.value)
        with pytest.raises(redis.ResponseError) as other:
            client.execute_command("NO-SUCH-COMMAND")
        assert not is_slot_moved(other.value)


def test_a_node_url_keeps_its_scheme_credentials_and_options():
    url = "rediss://user:pw@first:6379/0?ssl_cert_reqs=none"
    assert node_url_for(url, "10.0.0.2", 7001) == (
        "rediss://user:pw@10.0.0.2:7001/0?ssl_cert_reqs=none"
    )
    assert node_url_for("redis://a:1", "::1", 7002) == "redis://[::1]:7002"


def _beat(shard: BusConfig, worker_id: str) -> None:
    with redis.Redis.from_url(shard.redis_url) as client:
        client.sadd(shard.workers_key(), worker_id)
        client.set(shard.heartbeat_key(worker_id), b"beat", ex=60)


def _register_dead(shard: BusConfig, worker_id: str) -> None:
    with redis.Redis.from_url(shard.redis_url) as client:
        client.sadd(shard.workers_key(), worker_id)


def _read_as(shard: BusConfig, stream: str, group: str, consumer: str) -> None:
    with redis.Redis.from_url(shard.redis_url) as client:
        client.xgroup_create(stream, group, id="0", mkstream=True)
        client.xreadgroup(group, consumer, {stream: ">"}, count=1, block=1)
