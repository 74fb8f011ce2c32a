"""KV-aware routing on a real server: workers' prefix caches announce their blocks on the
kv-events stream, every router replica indexes them, and a job goes to the worker holding
its prompt's prefix unless load says otherwise.

Worker-side tests use the real RadixCache and a real Worker (a small random model); the
router's run the real stage and reaper, with workers as keys (a heartbeat and the set)."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from bus.actor import Actor
from bus.reconnect import ensure_group
from gpu_worker import Engine
from gpu_worker.cached_blocks import CachedBlocks
from gpu_worker.memory.allocator import PagedTokenAllocator
from gpu_worker.memory.radix_cache import RadixCache
from gpu_worker.worker import Worker
from jobs.kv_blocks import block_hashes, leading_run
from jobs.kv_events import KvEvents
from jobs.protocol import ENTRY_FIELD, Heartbeat, TokenBatch, TokenizedRequest, decode, encode
from jobs.token_records import Finish
from runtime.config import BusConfig
from stages.router.kv_index import KvIndex
from stages.router.stage import RouterStage
from stages.router.worker_reaper import WORKER_GROUP, WorkerReaper
from tests.test_worker_migration import _wait
from tests.worker_thread import published_entries

MODEL = "random:tiny-llama"
BLOCK = 4
GREEDY = {"ignore_eos": True, "temperature": 0.0}
SYSTEM = list(range(100, 132))  # a shared "system prompt" of 8 blocks


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, heartbeat_interval_s=0.2,
                     publish_interval_ms=20, no_worker_timeout_s=0.5,
                     kv_block_tokens=BLOCK)  # fmt: skip


# ---- block hashes ------------------------------------------------------------------------------


def test_block_hashes_are_chained_stable_and_name_whole_prefixes():
    ids = list(range(10))
    hashes = block_hashes(ids, 4)
    assert len(hashes) == 2  # the partial last block is not named
    assert hashes == block_hashes(ids[:8], 4)  # the same in any process: no salted hash()
    assert 0 <= hashes[0] < 2**64
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == hashes[0]
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != hashes[1]  # block 1 names its past
    assert block_hashes(ids, 4, start=1, parent=hashes[0]) == hashes[1:]
    assert block_hashes(ids, 4, start=1) == hashes[1:]  # without its parent: hashed anyway
    assert leading_run(hashes, {hashes[0]}) == 1
    assert leading_run(hashes, {hashes[1]}) == 0  # a cache reuses up to its first gap


def _cache() -> tuple[RadixCache, PagedTokenAllocator, CachedBlocks]:
    allocator = PagedTokenAllocator(256, 1, torch.device("cpu"))
    cache = RadixCache(allocator, 1)
    blocks = CachedBlocks("w", BLOCK, snapshot_interval_s=3600)
    cache.listener = blocks
    return cache, allocator, blocks


def _insert(cache: RadixCache, allocator: PagedTokenAllocator, key: list[int]) -> None:
    slots = allocator.alloc_extend([0], [len(key)], [0])
    allocator.free(slots[: cache.insert(key, slots)])


def test_the_tracked_blocks_follow_inserts_splits_and_evictions_of_the_radix_cache():
    cache, allocator, blocks = _cache()
    assert blocks.take() == KvEvents("w", [], [], snapshot=True)  # a new life holds nothing
    a, b = SYSTEM + [1, 2, 3, 4, 5], SYSTEM + [7, 7, 7, 7]
    _insert(cache, allocator, a)
    assert blocks.take() == KvEvents("w", block_hashes(a, BLOCK), [])
    _insert(cache, allocator, b)  # splits a's node after SYSTEM: only b's last block is new
    assert blocks.take() == KvEvents("w", block_hashes(b, BLOCK)[-1:], [])
    assert blocks.take() is None  # nothing changed: the publish carries no entry
    cache.match_prefix(a)  # b is older now: the first leaf evicted
    cache.evict(1)
    events = blocks.take()
    assert events.stored == [] and events.removed == block_hashes(b, BLOCK)[-1:]
    cache.evict(1000)  # every leaf, then the shared parent
    assert set(blocks.take().removed) == set(block_hashes(a, BLOCK))
    assert blocks.held == set()
    _insert(cache, allocator, a)
    cache.reset()  # a flush: the next entry says everything again
    assert blocks.take() == KvEvents("w", [], [], snapshot=True)


def test_a_block_stored_and_removed_between_two_publishes_is_not_sent():
    cache, allocator, blocks = _cache()
    blocks.take()
    _insert(cache, allocator, SYSTEM)
    cache.evict(1000)
    assert blocks.take() is None


# ---- the worker publishes; routers index -------------------------------------------------------


def _events(client: redis.Redis, config: BusConfig) -> list[KvEvents]:
    return [decode(f[ENTRY_FIELD], KvEvents) for _, f in client.xrange(config.kv_events_stream())]


def test_a_real_workers_stores_and_evictions_reach_every_router_index(redis_client, config):
    worker = Worker(Engine(MODEL, dtype="float32"), redis_client, config, "w", MODEL)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    prompt = SYSTEM + [5, 6, 7, 8]
    try:
        _wait(lambda: _events(redis_client, config))  # its start: an empty snapshot
        start = _events(redis_client, config)[0]
        assert (start.stored, start.removed, start.snapshot) == ([], [], True)
        assert (start.load.running, start.load.waiting, start.load.admitted) == (0, 0, 0)
        index = KvIndex(redis_client, config)
        job = TokenizedRequest("r1", "t:reply", prompt, {**GREEDY, "max_new_tokens": 6})
        redis_client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})
        hashes = block_hashes(prompt, BLOCK)
        _wait(lambda: index.refresh() >= 0 and index.cached_blocks(hashes, "w") == len(hashes))
        # Stores come in batches: an entry per publish that changed something, not per block.
        assert len(_events(redis_client, config)) <= 4
        restarted = KvIndex(redis_client, config)  # a router started mid-run rebuilds it
        restarted.refresh()
        assert restarted.by_worker == index.by_worker
        _wait(lambda: "r1" in _finished(redis_client, config))
        # The worker is idle, blocked on its stream: evict everything the cache holds.
        worker.scheduler.kv.prefix_cache.evict(10_000)
        _wait(lambda: index.refresh() >= 0 and index.cached_blocks(hashes, "w") == 0)
        assert index.by_worker["w"] == set() and index.holders == {}
    finally:
        worker.stop.set()
        thread.join(timeout=30)


# ---- the router's choice -----------------------------------------------------------------------


def _beat(client: redis.Redis, config: BusConfig, worker_id: str, running: int = 0,
          ttl_ms: int = 5_000, free_kv_tokens: int = 10_000,
          admitted: int = 0) -> None:  # fmt: skip
    beat = Heartbeat(worker_id, config.worker_stream(worker_id), MODEL, running, 0,
                     free_kv_tokens, 20_000, admitted, time.time())  # fmt: skip
    client.set(config.heartbeat_key(worker_id), encode(beat), px=ttl_ms)
    client.sadd(config.workers_key(), worker_id)


def _holds(client: redis.Redis, config: BusConfig, worker_id: str, ids: list[int]) -> None:
    events = KvEvents(worker_id, block_hashes(ids, BLOCK))
    client.xadd(config.kv_events_stream(), {ENTRY_FIELD: encode(events)})


def _router(client: redis.Redis, config: BusConfig) -> tuple[Actor, RouterStage]:
    stage = RouterStage(config, client, threading.Event())
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage, threading.Event()), stage


def _job(client: redis.Redis, config: BusConfig, rid: str, ids: list[int],
         sampling: dict | None = None) -> None:  # fmt: skip
    job = TokenizedRequest(rid, "t:reply", ids, sampling or {"max_new_tokens": 4})
    client.xadd(config.tokenized_stream(), {ENTRY_FIELD: encode(job)})


def _routed(client: redis.Redis, config: BusConfig, worker_id: str) -> list[str]:
    stream = config.worker_stream(worker_id)
    return [decode(f[ENTRY_FIELD], TokenizedRequest).rid for _, f in client.xrange(stream)]


def test_a_job_goes_to_the_worker_holding_its_prefix_and_load_only_routing_ignores_it(
    redis_client, config
):
    for worker_id in ("w1", "w2"):
        _beat(redis_client, config, worker_id)
    _holds(redis_client, config, "w2", SYSTEM)
    actor, stage = _router(redis_client, config)
    _job(redis_client, config, "kv", SYSTEM + [1, 2])
    actor.run_once()
    assert _routed(redis_client, config, "w2") == ["kv"]
    assert stage.index.cached_blocks(block_hashes(SYSTEM, BLOCK), "w2") == len(SYSTEM) // BLOCK

    load_only = BusConfig.from_env({}, **{**vars(config), "router_policy": "load"})
    actor, stage = _router(redis_client, load_only)
    assert stage.index is None
    _job(redis_client, config, "load", SYSTEM + [1, 2])
    actor.run_once()
    assert _routed(redis_client, config, "w1") == ["load"]  # w2 now has one in transit


def test_a_cold_burst_of_one_prefix_follows_its_first_job_across_router_batches(
    redis_client, config
):
    # A queued job weighs less than the 32-token prefix (as a 512-token system prompt does).
    config = BusConfig.from_env({}, **{**vars(config), "kv_job_load_tokens": 8})
    for worker_id in ("w1", "w2"):
        _beat(redis_client, config, worker_id)
    actor, stage = _router(redis_client, config)
    for i in range(3):  # one job per batch: no worker has said it holds the prefix yet
        _job(redis_client, config, f"c{i}", SYSTEM + [i])
        actor.run_once()
    holder = "w1" if _routed(redis_client, config, "w1") else "w2"
    assert _routed(redis_client, config, holder) == ["c0", "c1", "c2"]


@pytest.mark.parametrize("policy", ["kv", "load"])
def test_cold_jobs_one_at_a_time_spread_over_an_idle_fleet(redis_client, config, policy):
    # Each job finished before the next came: every worker reads as idle, with the same free
    # KV. The tie goes to the worker routed the fewest jobs, not always to the first by id.
    config = BusConfig.from_env({}, **{**vars(config), "router_policy": policy})
    actor, _ = _router(redis_client, config)
    for i in range(6):
        for worker_id in ("w1", "w2"):
            _beat(redis_client, config, worker_id, admitted=len(_routed(redis_client, config,
                                                                         worker_id)))  # fmt: skip
        _job(redis_client, config, f"cold-{i}", [900 + i])
        actor.run_once()
    assert len(_routed(redis_client, config, "w1")) == len(_routed(redis_client, config, "w2")) == 3


@pytest.mark.parametrize("balance_jobs", [4, 2])
def test_a_cold_burst_in_one_router_batch_sends_each_prefix_to_one_worker(
    redis_client, config, balance_jobs
):
    # A queued job weighs against the 32-token prefixes what the default 64 tokens weigh
    # against a 512-token system prompt.
    config = BusConfig.from_env({}, **{**vars(config), "kv_job_load_tokens": 4,
                                       "kv_balance_jobs": balance_jobs})  # fmt: skip
    workers = ("w1", "w2", "w3", "w4")
    for worker_id in workers:
        _beat(redis_client, config, worker_id)
    prefixes = [list(range(200 + 40 * p, 232 + 40 * p)) for p in range(3)]
    actor, _ = _router(redis_client, config)
    for turn in range(4):
        for p, prefix in enumerate(prefixes):
            _job(redis_client, config, f"p{p}-{turn}", prefix + [turn])
    actor.run_once()  # all twelve in one batch, before any worker holds anything
    where = {rid: w for w in workers for rid in _routed(redis_client, config, w)}
    assert len(where) == 12
    firsts = [where[f"p{p}-0"] for p in range(3)]
    assert len(set(firsts)) == 3, where  # cold prefixes spread by load
    for p in range(3):  # the later jobs of a prefix follow its first
        assert [where[f"p{p}-{turn}"] for turn in range(3)] == [firsts[p]] * 3, where
    # The fourth job of the first prefix finds its holder 3 jobs ahead of the idle worker:
    # within a balance of 4; past one of 2, so the idle worker takes it (and the prefix).
    idle = (set(workers) - set(firsts)).pop()
    assert where["p0-3"] == (firsts[0] if balance_jobs == 4 else idle), where
    assert [where["p1-3"], where["p2-3"]] == firsts[1:], where


def test_a_hot_prefix_is_replicated_past_the_balance_threshold(redis_client, config):
    config = BusConfig.from_env({}, **{**vars(config), "kv_balance_jobs": 2,
                                       "kv_job_load_tokens": 0})  # fmt: skip
    for worker_id in ("w1", "w2"):
        _beat(redis_client, config, worker_id)
    _holds(redis_client, config, "w1", SYSTEM)
    actor, stage = _router(redis_client, config)
    for i in range(8):
        _job(redis_client, config, f"r{i}", SYSTEM + [i])
    actor.run_once()
    # The holder takes jobs until it is 3 ahead; then the other takes one and holds the
    # prefix too, so the two score alike and the load order evens their queues.
    counts = [len(_routed(redis_client, config, w)) for w in ("w1", "w2")]
    assert counts == [4, 4], counts
    assert _routed(redis_client, config, "w1")[:3] == ["r0", "r1", "r2"]
    assert _routed(redis_client, config, "w2")[:3] == ["r3", "r4", "r5"]


def test_a_workers_entries_go_when_its_heartbeat_does(redis_client, config):
    _beat(redis_client, config, "w1")
    _beat(redis_client, config, "w2", ttl_ms=1_000)
    _holds(redis_client, config, "w2", SYSTEM)
    actor, stage = _router(redis_client, config)
    _job(redis_client, config, "r0", [1])
    actor.run_once()
    assert "w2" in stage.index.by_worker
    _wait(lambda: not redis_client.exists(config.heartbeat_key("w2")))  # w2 lapses
    _job(redis_client, config, "r1", SYSTEM + [1])
    actor.run_once()
    assert "w2" not in stage.index.by_worker
    assert all(workers == {"w1"} for workers in stage.index.holders.values())  # r1's, expected
    assert _routed(redis_client, config, "w1") == ["r0", "r1"]


def test_a_dead_workers_job_migrates_to_the_worker_holding_its_prefix(redis_client, config):
    prompt = SYSTEM + [1, 2, 3]
    # w0 had the job pending when it died (no heartbeat); w2 holds the job's prefix.
    redis_client.sadd(config.workers_key(), "w0")
    redis_client.xgroup_create(config.worker_stream("w0"), WORKER_GROUP, id="0", mkstream=True)
    job = TokenizedRequest("r1", "t:reply", prompt, {"max_new_tokens": 4})
    redis_client.xadd(config.worker_stream("w0"), {ENTRY_FIELD: encode(job)})
    _holds(redis_client, config, "w0", prompt)
    _holds(redis_client, config, "w2", SYSTEM)
    for worker_id in ("w1", "w2", "w3"):
        _beat(redis_client, config, worker_id)
    assert WorkerReaper(redis_client, config, "router-a", threading.Event()).reap("w0")
    actor, _ = _router(redis_client, config)
    actor.run_once()
    assert _routed(redis_client, config, "w2") == ["r1"]


def test_a_router_started_mid_run_rebuilds_its_index_and_routes_to_the_holder(redis_client, config):
    # A job weighs against the 32-token prefix what 64 tokens weigh against a 512-token one
    # (w1's heartbeat may still count r1 when r2 is routed).
    config = BusConfig.from_env({}, **{**vars(config), "kv_job_load_tokens": 4})
    worker = Worker(Engine(MODEL, dtype="float32"), redis_client, config, "w1", MODEL)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        _wait(lambda: redis_client.exists(config.heartbeat_key("w1")))
        first, _ = _router(redis_client, config)  # the router before the restart
        _job(redis_client, config, "r1", SYSTEM + [5, 6, 7, 8], {**GREEDY, "max_new_tokens": 4})
        first.run_once()
        _wait(lambda: "r1" in _finished(redis_client, config))
        probe = KvIndex(redis_client, config)  # w1's stores are on the stream
        hashes = block_hashes(SYSTEM, BLOCK)
        _wait(lambda: probe.refresh() >= 0 and probe.cached_blocks(hashes, "w1") == len(hashes))
        # A second worker, idle and with the most free KV: the load order's favourite, which
        # a router that knew nothing of the caches would pick.
        _beat(redis_client, config, "w2", free_kv_tokens=10**9)
        restarted, stage = _router(redis_client, config)  # a new process: a new stage, index
        _job(redis_client, config, "r2", SYSTEM + [9], {**GREEDY, "max_new_tokens": 4})
        restarted.run_once()
        assert _routed(redis_client, config, "w1") == ["r1", "r2"]
        assert _routed(redis_client, config, "w2") == []
        assert stage.index.cached_blocks(hashes, "w1") == len(hashes)
        _wait(lambda: "r2" in _finished(redis_client, config))
        finish = _finishes(redis_client, config)["r2"]
        assert (finish.route_reason, finish.expected_cached_tokens) == ("prefix", len(SYSTEM))
        assert finish.cached_tokens >= len(SYSTEM)
    finally:
        worker.stop.set()
        thread.join(timeout=30)


def test_greedy_output_is_the_same_whichever_worker_the_router_picks(redis_client, config):
    expected = Engine(MODEL, dtype="float32").generate(
        input_ids=SYSTEM + [9], sampling_params={**GREEDY, "max_new_tokens": 8}
    )["output_ids"]
    # These prompts are short: a job in flight must not outweigh the blocks a worker holds.
    config = BusConfig.from_env({}, **{**vars(config), "kv_job_load_tokens": 1})
    workers = [Worker(Engine(MODEL, dtype="float32"), redis_client, config, w, MODEL)
               for w in ("w1", "w2")]  # fmt: skip
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    actor, stage = _router(redis_client, config)
    try:
        _wait(lambda: len(redis_client.smembers(config.workers_key())) == 2)
        for i in range(4):  # the first fills a cache; the others are routed to its holder
            _job(redis_client, config, f"r{i}", SYSTEM + [9], {**GREEDY, "max_new_tokens": 8})
            actor.run_once()
            _wait(lambda i=i: f"r{i}" in _finished(redis_client, config))
    finally:
        for worker in workers:
            worker.stop.set()
        for thread in threads:
            thread.join(timeout=30)
    outputs = _finished(redis_client, config)
    assert [outputs[f"r{i}"] for i in range(4)] == [expected] * 4
    # Each Finish says why the router chose its worker, and what it expected cached there.
    finishes = _finishes(redis_client, config)
    assert finishes["r0"].route_reason == "load" and finishes["r0"].expected_cached_tokens == 0
    later = [finishes[f"r{i}"] for i in range(1, 4)]
    assert all(f.route_reason == "prefix" and f.expected_cached_tokens == 32 for f in later)
    assert all(f.cached_tokens >= f.expected_cached_tokens for f in later)
    holder = [w.worker_id for w in workers if w.jobs == {} and w.admitted >= 3]
    assert holder, [w.admitted for w in workers]  # the later turns went to the prefix holder


def _finished(client: redis.Redis, config: BusConfig) -> dict[str, list[int]]:
    """rid -> output ids, of the jobs whose last item was published."""
    ids: dict[str, list[int]] = {}
    done = set()
    for _, fields in published_entries(client, config):
        for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
            ids.setdefault(item.rid, []).extend(item.ids)
            if item.finish is not None:
                done.add(item.rid)
    return {rid: ids[rid] for rid in done}


def _finishes(client: redis.Redis, config: BusConfig) -> dict[str, Finish]:
    return {
        item.rid: item.finish
        for _, f in published_entries(client, config)
        for item in decode(f[ENTRY_FIELD], TokenBatch).items
        if item.finish is not None
    }
