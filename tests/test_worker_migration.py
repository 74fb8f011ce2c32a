"""A request moves off a stopped worker and finishes on another, with no token repeated or
missing: real workers (a small random model), the reaper and the router stage, on a real
server."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from bus.actor import Actor
from bus.fence_off import read_progress_log
from bus.reconnect import ensure_group
from gpu_worker import Engine
from gpu_worker.worker import Worker
from jobs.progress import rebuild
from jobs.protocol import ENTRY_FIELD, TokenBatch, TokenizedRequest, decode, encode
from runtime.config import BusConfig
from stages.router.stage import RouterStage
from stages.router.worker_reaper import WorkerReaper
from tests.worker_thread import published_entries

MODEL = "random:tiny-llama"
PROMPT = [5, 17, 99, 3, 250, 41, 7, 12]
# Long enough that no host finishes it between two looks at the progress log: a finished
# job's log is trimmed at once, so the test must catch the worker mid-way.
MAX_NEW = 400


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, heartbeat_interval_s=0.2)


def _start(
    client: redis.Redis, config: BusConfig, worker_id: str
) -> tuple[Worker, threading.Thread]:
    worker = Worker(Engine(MODEL, dtype="float32"), client, config, worker_id, MODEL)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def _items(client: redis.Redis, config: BusConfig, rid: str):
    for _, fields in published_entries(client, config):
        batch = decode(fields[ENTRY_FIELD], TokenBatch)
        for item in batch.items:
            if item.rid == rid:
                yield batch.worker_id, item


def _logged(client: redis.Redis, config: BusConfig, worker_id: str, rid: str) -> int:
    """How many of `rid`'s output ids the worker's progress log holds."""
    return len(rebuild(read_progress_log(client, config, worker_id), {rid: []})[rid])


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


LONG_JOB = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0.0}


def _first_worker_part_way(
    client: redis.Redis, config: BusConfig
) -> tuple[list[int], Worker, threading.Thread]:
    """A clean server, the job's expected output, and worker "first" 10 tokens into it (on
    a failure before that, stopped)."""
    client.flushall()
    expected = Engine(MODEL, dtype="float32").generate(input_ids=PROMPT, sampling_params=LONG_JOB)
    worker, thread = _start(client, config, "first")
    try:
        job = TokenizedRequest("r1", "t:reply", PROMPT, LONG_JOB)
        client.xadd(config.worker_stream("first"), {ENTRY_FIELD: encode(job)})
        _wait(lambda: _logged(client, config, "first", "r1") >= 10)
    except BaseException:
        worker.stop.set()
        thread.join(timeout=30)
        raise
    return expected["output_ids"], worker, thread


def test_a_request_continues_on_another_worker_after_its_worker_stops(redis_url, config):
    client = redis.Redis.from_url(redis_url)
    expected, first, first_thread = _first_worker_part_way(client, config)
    # Stop it part-way, as SIGTERM does: it publishes its last step and leaves the job.
    first.stop.set()
    first_thread.join(timeout=30)
    produced = _logged(client, config, "first", "r1")
    assert 10 <= produced < MAX_NEW
    assert client.xpending(config.worker_stream("first"), "worker")["pending"] == 1

    second, second_thread = _start(client, config, "second")
    try:
        reaper = WorkerReaper(client, config, "router-test", threading.Event())
        assert reaper.reap("first")
        router = RouterStage(config, client, threading.Event())
        ensure_group(client, router.input_stream(config), router.group)
        _wait(lambda: client.exists(config.heartbeat_key("second")))
        assert Actor(client, config, router).run_once() == 1
        _wait(lambda: any(item.finish for _, item in _items(client, config, "r1")))
    finally:
        second.stop.set()
        second_thread.join(timeout=30)

    items = list(_items(client, config, "r1"))
    ids, expected_start = [], 0
    for _, item in items:
        assert item.start == expected_start  # no gap, no repeat
        ids += item.ids
        expected_start += len(item.ids)
    assert ids == expected
    assert {worker for worker, _ in items} == {"first", "second"}
    assert items[-1][1].finish.completion_tokens == MAX_NEW
    assert items[-1][1].finish.prompt_tokens == len(PROMPT)
    assert not client.exists(config.progress_stream("first"))  # gone with the worker
    assert client.xpending(config.worker_stream("second"), "worker")["pending"] == 0


def test_a_worker_taken_for_dead_while_alive_publishes_nothing_for_jobs_moved_off_it(
    redis_url, config
):
    """A false death (a pause, a cut-off longer than the heartbeat TTL): the reaper claims
    the job while its worker still runs it. From the claim on, the old worker writes
    nothing for it, so the progress a new owner resumes from is final; the job then
    resumes (here on the same worker, the only live one) with no token repeated."""
    client = redis.Redis.from_url(redis_url)
    expected, worker, thread = _first_worker_part_way(client, config)
    try:
        reaper = WorkerReaper(client, config, "router-test", threading.Event())
        reaper.reap("first")  # "left alone" at the end: it is beating
        produced = _logged(client, config, "first", "r1")
        assert produced < MAX_NEW
        assert client.xlen(config.tokenized_stream()) == 1  # the job, moved
        _wait(lambda: "r1" not in worker.jobs)  # it learns at its next write, and drops it
        time.sleep(0.3)
        assert _logged(client, config, "first", "r1") == produced
        assert max(i.start + len(i.ids) for _, i in _items(client, config, "r1")) == produced

        router = RouterStage(config, client, threading.Event())
        ensure_group(client, router.input_stream(config), router.group)
        assert Actor(client, config, router).run_once() == 1  # back to "first"
        _wait(lambda: any(item.finish for _, item in _items(client, config, "r1")))
    finally:
        worker.stop.set()
        thread.join(timeout=30)

    ids, expected_start = [], 0
    for _, item in _items(client, config, "r1"):
        assert item.start == expected_start  # no gap, no repeat
        ids += item.ids
        expected_start += len(item.ids)
    assert ids == expected
