"""Poison jobs: a job that makes a worker fail is set aside with an error reply, and no job's
content ends the process. Real workers (a small random model), the reaper, on a real server.

A forward hook (tests/hook_factories.py) makes every step whose batch holds one token id
raise, so a job whose prompt holds it breaks every step it is in: the jobs beside it must
still finish with the tokens they get alone.
"""

from __future__ import annotations

import threading

import pytest
import redis

from bus.reconnect import ensure_group
from gpu_worker import Engine
from gpu_worker.worker import Worker
from jobs.protocol import (
    ENTRY_FIELD,
    ErrorReply,
    TextDelta,
    TokenBatch,
    TokenizedRequest,
    decode,
    encode,
)
from runtime.config import BusConfig
from stages.router.worker_reaper import WorkerReaper
from tests.worker_thread import published_entries

MODEL = "random:tiny-llama"
POISON_TOKEN = 424
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    hook = {
        "name": "poison",
        "target_modules": "model.embed_tokens",
        "hook_factory": "tests.hook_factories:raise_on_token",
        "config": {"token": POISON_TOKEN},
    }
    return Engine(MODEL, dtype="float32", forward_hooks=[hook])


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=5)


def _worker(engine, client: redis.Redis, config: BusConfig, worker_id: str = "w") -> Worker:
    worker = Worker(engine, client, config, worker_id, MODEL)
    worker._inbox = worker.bus.open()
    return worker


def _send(client, config, stream: str, rid: str, ids: list[int], **fields) -> None:
    job = TokenizedRequest(rid, "t:replies", ids, dict(GREEDY), **fields)
    client.xadd(stream, {ENTRY_FIELD: encode(job)})


def _run(worker: Worker, turns: int = 400) -> None:
    for _ in range(turns):
        worker._turn()
        if not worker.jobs and not worker._inbox:
            return
    raise AssertionError(f"jobs still running: {list(worker.jobs)}")


def _outputs(client: redis.Redis) -> dict[str, list[int] | ErrorReply]:
    """Each rid's generated tokens, from the token batches; or its error reply."""
    outputs: dict[str, list[int] | ErrorReply] = {}
    for _, fields in published_entries(client, BusConfig()):
        for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
            outputs.setdefault(item.rid, []).extend(item.ids)
    for _, fields in client.xrange("t:replies"):
        reply = decode(fields[ENTRY_FIELD], ErrorReply, TextDelta)
        if isinstance(reply, ErrorReply):
            outputs[reply.rid] = reply
    return outputs


def test_a_job_that_breaks_every_step_is_set_aside_and_the_jobs_beside_it_finish(
    redis_client, config, engine
):
    worker = _worker(engine, redis_client, config)
    prompts = {f"ok-{i}": [5 + i, 17, 99, 3, 250] for i in range(3)}
    for rid, ids in prompts.items():
        _send(redis_client, config, worker.bus.stream, rid, ids)
    _send(redis_client, config, worker.bus.stream, "poison", [5, POISON_TOKEN, 7])
    _run(worker)

    outputs = _outputs(redis_client)
    error = outputs["poison"]
    assert isinstance(error, ErrorReply)
    assert (error.status, error.code) == (500, "poison_job")
    for rid, ids in prompts.items():
        alone = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
        assert outputs[rid] == alone, rid  # nothing repeated or missing after the restarts
    (dead,) = redis_client.xrange(config.dead_letter_stream())
    assert b"failed 3 times" in dead[1][b"reason"]
    assert worker.metrics.step_failures._value.get() == config.max_deliveries
    assert redis_client.xpending(worker.bus.stream, "worker")["pending"] == 0
    # The engine was left clean: every KV page is back, and it serves the next job.
    _send(redis_client, config, worker.bus.stream, "after", [1, 2, 3])
    _run(worker)
    assert len(_outputs(redis_client)["after"]) == GREEDY["max_new_tokens"]


def test_a_job_whose_admission_raises_gets_its_error_and_the_worker_serves_on(
    redis_client, config, engine
):
    worker = _worker(engine, redis_client, config)
    deep = "[" * 100_000
    job = TokenizedRequest("deep", "t:replies", [1, 2, 3], {**GREEDY, "json_schema": deep})
    redis_client.xadd(worker.bus.stream, {ENTRY_FIELD: encode(job)})
    _send(redis_client, config, worker.bus.stream, "next", [1, 2, 3])
    _run(worker)
    outputs = _outputs(redis_client)
    assert isinstance(outputs["deep"], ErrorReply) and outputs["deep"].status == 400
    assert len(outputs["next"]) == GREEDY["max_new_tokens"]


def test_a_malformed_job_naming_its_requester_is_answered(redis_client, config, engine):
    import msgpack

    worker = _worker(engine, redis_client, config)
    bad = {"kind": "tokenized", "rid": "bad", "reply_to": "t:replies", "input_ids": [1, 2]}
    redis_client.xadd(worker.bus.stream, {ENTRY_FIELD: msgpack.packb(bad)})
    _run(worker)
    error = _outputs(redis_client)["bad"]
    assert isinstance(error, ErrorReply) and error.status == 400
    assert "input_ids" in error.message
    assert redis_client.xlen(config.dead_letter_stream()) == 1


def test_a_job_whose_workers_died_max_deliveries_times_is_not_requeued(
    redis_client, config, engine
):
    """The reaper adds each dead worker's deliveries to the job's attempts; at the limit it
    dead-letters the job and answers its requester instead of handing it on."""
    reaper = WorkerReaper(redis_client, config, "reaper", threading.Event())
    for death in range(1, config.max_deliveries + 1):
        stream = config.worker_stream(f"dead-{death}")
        ensure_group(redis_client, stream, "worker")
        if death == 1:
            _send(redis_client, config, stream, "killer", [1, 2, 3])
        else:  # what the reaper requeued, as the router would route it
            ((entry_id, fields),) = redis_client.xrange(config.tokenized_stream())
            redis_client.xdel(config.tokenized_stream(), entry_id)
            redis_client.xadd(stream, fields)
        # The worker reads the job, then dies holding it (no heartbeat, job pending).
        redis_client.xreadgroup("worker", "doomed", {stream: ">"})
        redis_client.sadd(config.workers_key(), f"dead-{death}")
        assert reaper.reap(f"dead-{death}")
    assert redis_client.xlen(config.tokenized_stream()) == 0
    (error,) = [decode(f[ENTRY_FIELD], ErrorReply) for _, f in redis_client.xrange("t:replies")]
    assert (error.rid, error.code) == ("killer", "poison_job")
    (dead,) = redis_client.xrange(config.dead_letter_stream())
    assert b"died 3 times" in dead[1][b"reason"]


def test_a_worker_restarted_under_its_id_counts_its_previous_lives(redis_client, config, engine):
    stream = config.worker_stream("again")
    ensure_group(redis_client, stream, "worker")
    # Moved once off a dead worker (attempts=1), then two lives under this id died holding it.
    _send(redis_client, config, stream, "killer", [1, 2, 3], attempts=1)
    redis_client.xreadgroup("worker", "first-life", {stream: ">"})
    redis_client.xautoclaim(stream, "worker", "second-life", 0, "0-0")
    worker = _worker(engine, redis_client, config, "again")  # the third life
    _run(worker)
    error = _outputs(redis_client)["killer"]
    assert isinstance(error, ErrorReply) and error.code == "poison_job"
    assert redis_client.xpending(stream, "worker")["pending"] == 0
