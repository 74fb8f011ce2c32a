"""A worker never waits for a grammar to compile: the job waits (gpu_worker/grammar_waits.py)
while the engine serves the others, and one whose compile passes the deadline gets a 400
naming its field. The compile pool is held busy by the test, so "slow" is certain."""

from __future__ import annotations

import json

import pytest

from bus.aborts import publish_aborts
from gpu_worker import Engine
from gpu_worker.worker import Worker
from jobs.protocol import ENTRY_FIELD, ErrorReply, TokenizedRequest, encode
from jobs.request_bounds import request_bounds
from runtime.config import BusConfig
from tests.test_poison_jobs import _outputs

MODEL = "smollm2-135m-instruct"


def schema(name: str) -> str:
    """A schema never compiled before in this process: its own property name."""
    properties = {name: {"type": "integer"}}
    return json.dumps({"type": "object", "properties": properties, "required": [name]})


GREEDY = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def engine():
    return Engine(MODEL, dtype="float32")


def _send(client, worker: Worker, rid: str, **sampling) -> None:
    job = TokenizedRequest(rid, "t:replies", [1, 2, 3, 4], {**GREEDY, **sampling})
    client.xadd(worker.bus.stream, {ENTRY_FIELD: encode(job)})


def _turns(worker: Worker, until, limit: int = 2000) -> None:
    for _ in range(limit):
        worker._turn()
        if until():
            return
    raise AssertionError("never happened")


def test_a_job_waits_for_its_grammar_while_the_engine_serves_the_others(
    redis_client, redis_url, engine, busy_compile_pool
):
    worker = Worker(engine, redis_client, BusConfig(redis_url=redis_url, block_ms=5), "g", MODEL)
    worker._inbox = worker.bus.open()
    _send(redis_client, worker, "schema", json_schema=schema("count"))
    _send(redis_client, worker, "plain")
    _turns(worker, lambda: "plain" in _outputs(redis_client) and "plain" not in worker.jobs)
    assert "schema" in worker.grammar_waits and "schema" not in _outputs(redis_client)
    busy_compile_pool.set()
    _turns(worker, lambda: not worker.jobs and not len(worker.grammar_waits))
    outputs = _outputs(redis_client)
    assert not isinstance(outputs["schema"], ErrorReply) and outputs["schema"]


def test_a_grammar_past_its_compile_deadline_is_a_400_naming_the_field(
    redis_client, redis_url, engine, busy_compile_pool, monkeypatch
):
    monkeypatch.setenv("STREAMSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "0.3")
    request_bounds.cache_clear()
    try:
        config = BusConfig(redis_url=redis_url, block_ms=5)
        worker = Worker(engine, redis_client, config, "late", MODEL)
        worker._inbox = worker.bus.open()
        _send(redis_client, worker, "late", json_schema=schema("late"))
        _turns(worker, lambda: "late" in _outputs(redis_client))
    finally:
        monkeypatch.undo()
        request_bounds.cache_clear()
    error = _outputs(redis_client)["late"]
    assert isinstance(error, ErrorReply)
    assert (error.status, error.param) == (400, "json_schema")
    assert "took longer" in error.message
    assert redis_client.xpending(worker.bus.stream, "worker")["pending"] == 0


def test_a_job_waiting_for_its_grammar_is_ended_by_its_abort_flag(
    redis_client, redis_url, engine, busy_compile_pool
):
    """The worker reads the flags of the jobs waiting beside the engine too (bus/aborts.py):
    an aborted one ends while its grammar still compiles, not once it has started."""
    config = BusConfig(redis_url=redis_url, block_ms=5, abort_check_interval_ms=0)
    worker = Worker(engine, redis_client, config, "g", MODEL)
    worker._inbox = worker.bus.open()
    _send(redis_client, worker, "schema", json_schema=schema("aborted"))
    _turns(worker, lambda: "schema" in worker.grammar_waits)
    publish_aborts(redis_client, config, ["schema"])
    _turns(worker, lambda: "schema" in _outputs(redis_client))
    assert "schema" not in worker.grammar_waits
    assert _outputs(redis_client)["schema"] == []  # ended with no token (not the 400 of a
    # compile past its deadline, which the busy pool would have given it)
    assert redis_client.xpending(worker.bus.stream, "worker")["pending"] == 0
