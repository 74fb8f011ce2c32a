"""A router batch's jobs for one worker ride in one entry of its stream, and that entry is
acknowledged once its last job ends (gpu_worker/job_ends.py): each job's end is a mark on the
worker's progress log, so the reaper and a restarted worker run again only the jobs that had
not ended. Real workers (a small random model, float32) on a real server."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from bus.actor import Inbound
from bus.effects import write_outputs
from bus.fence_off import read_progress_log
from bus.fenced_stream import WORKER_GROUP
from gpu_worker import Engine
from gpu_worker.worker import Worker
from jobs.progress import ProgressEntry, ended_jobs
from jobs.protocol import Heartbeat, TokenBatch, TokenizedRequest, decode
from jobs.wire import ENTRY_FIELD, JOBS_FIELD, encode, job_entries, job_payloads
from runtime.config import BusConfig
from stages.router.stage import RouterStage
from stages.router.worker_reaper import WorkerReaper

# A small random model, ~20 ms a step: a long job still runs when a short one has ended.
from tests.test_bus_batching import GREEDY, MODEL, PROMPT, _start
from tests.worker_thread import published_entries, wait_until


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, heartbeat_interval_s=0.2,
                     publish_interval_ms=50, trim_interval_s=0.05)  # fmt: skip


def _beat(client: redis.Redis, config: BusConfig, worker_id: str, reads_bundles: bool) -> None:
    beat = Heartbeat(worker_id, config.worker_stream(worker_id), MODEL, 0, 0, 10_000, 20_000,
                     0, time.time(), reads_bundles=reads_bundles)  # fmt: skip
    client.set(config.heartbeat_key(worker_id), encode(beat), px=5_000)
    client.sadd(config.workers_key(), worker_id)


def _jobs(n: int, tokens: int = 4) -> list[TokenizedRequest]:
    return [TokenizedRequest(f"r{i}", "t:reply", PROMPT[i % 4 :],
                             {**GREEDY, "max_new_tokens": tokens}) for i in range(n)]  # fmt: skip


def _rids(client: redis.Redis, stream: str) -> list[list[str]]:
    """Per entry of `stream`, the rids of its jobs."""
    return [[decode(p, TokenizedRequest).rid for p in job_payloads(fields)]
            for _, fields in client.xrange(stream)]  # fmt: skip


def _outputs(client: redis.Redis, config: BusConfig) -> dict[str, list[int]]:
    """rid -> its published ids, checked for no gap and no repeat; and each finished once."""
    ids: dict[str, list[int]] = {}
    finishes: dict[str, int] = {}
    for _, fields in published_entries(client, config):
        for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
            have = ids.setdefault(item.rid, [])
            assert item.start <= len(have), (item.rid, item.start, len(have))
            ids[item.rid] = have[: item.start] + item.ids
            if item.finish is not None:
                finishes[item.rid] = finishes.get(item.rid, 0) + 1
    assert all(count == 1 for count in finishes.values()), finishes
    return ids


def _started(
    client: redis.Redis, config: BusConfig, worker_id: str
) -> tuple[Worker, threading.Thread]:
    """A worker serving (its group made: its first heartbeat is written after)."""
    worker, thread = _start(client, config, worker_id)
    wait_until(lambda: client.exists(config.heartbeat_key(worker_id)))
    return worker, thread


def _expected(job: TokenizedRequest) -> list[int]:
    engine = Engine(MODEL, dtype="float32")
    return engine.generate(input_ids=job.input_ids, sampling_params=job.sampling)["output_ids"]


def _pending(client: redis.Redis, config: BusConfig, worker_id: str) -> int:
    return client.xpending(config.worker_stream(worker_id), WORKER_GROUP)["pending"]


def test_a_router_batch_is_one_entry_for_a_worker_that_reads_bundles(redis_client, config):
    _beat(redis_client, config, "new", reads_bundles=True)
    _beat(redis_client, config, "old", reads_bundles=False)  # a worker from before bundles
    router = RouterStage(config, redis_client, threading.Event())
    outputs = router.handle([Inbound(b"0-1", job) for job in _jobs(8)])
    pipe = redis_client.pipeline(transaction=True)
    write_outputs(pipe, config, outputs)
    pipe.execute()
    new = _rids(redis_client, config.worker_stream("new"))
    old = _rids(redis_client, config.worker_stream("old"))
    assert len(new) == 1 and len(new[0]) >= 2  # the load spreads the 8 over both
    assert all(len(rids) == 1 for rids in old) and len(old) >= 2
    assert sorted(new[0] + [rids[0] for rids in old]) == [f"r{i}" for i in range(8)]
    # The routed counts still count jobs, not entries (the router's load reads them).
    routed = redis_client.hgetall(config.routed_key())
    assert routed == {b"new": str(len(new[0])).encode(), b"old": str(len(old)).encode()}


def test_a_bundle_is_acknowledged_when_its_last_job_ends(redis_client, config):
    short, long = _jobs(2)
    long.sampling = {**GREEDY, "max_new_tokens": 60}
    worker, thread = _started(redis_client, config, "w")
    try:
        stream = config.worker_stream("w")
        redis_client.xadd(stream, {JOBS_FIELD: _bundle(short, long)})
        wait_until(lambda: "r0" in _finished(redis_client, config))
        assert "r1" not in _finished(redis_client, config)
        assert _pending(redis_client, config, "w") == 1  # r1 still runs: the entry waits
        # The short job's end is on the log, where a reader of it finds it.
        assert ended_jobs(read_progress_log(redis_client, config, "w")) == {"r0"}
        wait_until(lambda: "r1" in _finished(redis_client, config))
        wait_until(lambda: _pending(redis_client, config, "w") == 0)
    finally:
        worker.stop.set()
        thread.join(timeout=30)
    outputs = _outputs(redis_client, config)
    assert outputs["r0"] == _expected(short) and outputs["r1"] == _expected(long)


def _bundle(*jobs: TokenizedRequest) -> bytes:
    """One bundle entry's ``jobs`` field, as a router writes it."""
    (fields,) = job_entries([encode(job) for job in jobs])
    return fields[JOBS_FIELD]


def _finished(client: redis.Redis, config: BusConfig) -> set[str]:
    return {item.rid for _, fields in published_entries(client, config)
            for item in decode(fields[ENTRY_FIELD], TokenBatch).items if item.finish}  # fmt: skip


@pytest.mark.parametrize("after", ["reaper", "restart"])
def test_only_the_jobs_of_a_bundle_that_had_not_ended_run_again(redis_client, config, after):
    short, long = _jobs(2)
    long.sampling = {**GREEDY, "max_new_tokens": 300}
    worker, thread = _started(redis_client, config, "w")
    try:
        redis_client.xadd(config.worker_stream("w"), {JOBS_FIELD: _bundle(short, long)})
        wait_until(lambda: "r0" in _finished(redis_client, config))
        wait_until(lambda: len(_outputs(redis_client, config).get("r1", [])) >= 5)
    finally:
        worker.stop.set()  # as SIGTERM: publishes what it generated, leaves the entry pending
        thread.join(timeout=30)
    assert _pending(redis_client, config, "w") == 1
    if after == "reaper":
        redis_client.delete(config.heartbeat_key("w"))
        reaper = WorkerReaper(redis_client, config, "router-a", threading.Event())
        assert reaper.reap("w")
        entries = redis_client.xrange(config.tokenized_stream())
        moved = [decode(p, TokenizedRequest) for _, f in entries for p in job_payloads(f)]
        assert [job.rid for job in moved] == ["r1"]  # r0 ended: acknowledged, not moved
        assert moved[0].progress == _outputs(redis_client, config)["r1"]
        assert moved[0].attempts == 1
        return
    second, thread = _started(redis_client, config, "w")  # the same id: takes the entry back
    try:
        wait_until(lambda: "r1" in _finished(redis_client, config))
        wait_until(lambda: _pending(redis_client, config, "w") == 0)
    finally:
        second.stop.set()
        thread.join(timeout=30)
    outputs = _outputs(redis_client, config)  # r0 finished once: not run again
    assert outputs["r0"] == _expected(short) and outputs["r1"] == _expected(long)


def test_the_log_names_an_ended_job_by_its_slot_or_its_rid():
    named = ProgressEntry("w", slots=[ProgressEntry.slot(0, 0, [1, 2], "a")])
    later = ProgressEntry("w", slots=[ProgressEntry.slot(0, 2, [3])], done=[0, "b"])
    bad = ProgressEntry("w", done=[1.5])  # neither a slot nor a rid: the entry is skipped
    unnamed = ProgressEntry("w", done=[7])  # a slot no entry named (trimmed): skipped
    decoded = [decode(encode(e), ProgressEntry) for e in (named, later, bad, unnamed)]
    assert ended_jobs(decoded) == {"a", "b"}
