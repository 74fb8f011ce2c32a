"""A weight update under load: two real workers behind the real router stage, a stream of
requests on the bus while the fleet's weights change from checkpoint A to B. Every request
finishes, each names the version that served it, and its tokens are a single-version run of
that version (no request is lost or mixes two versions, no answer reuses A's KV under B).
The paused seconds per worker are logged (benchmarks/NOTES.md quotes them)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from bus.actor import Actor
from bus.reconnect import ensure_group
from bus.weights_admin import read_fleet, set_weights
from gpu_worker import Engine
from gpu_worker.worker import Worker
from jobs.protocol import ENTRY_FIELD, TokenBatch, TokenizedRequest, decode, encode
from jobs.weights import initial_version
from runtime.config import BusConfig
from stages.router.stage import RouterStage
from tests.weights_checkpoints import GREEDY, expected_outputs, save_checkpoint
from tests.worker_thread import published_entries

logger = logging.getLogger(__name__)

PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(8 + 5 * i)] for i in range(6)]
MAX_NEW = 48
REQUESTS = 48
UPDATE_AFTER = 16  # requests sent before the update is asked for
SEND_EVERY_S = 0.01  # faster than they finish: the workers are busy when the update comes


def _wait(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _answers(client, config) -> dict[str, tuple[list[int], str | None, str]]:
    """rid -> (output ids, the version its Finish names, the worker that finished it)."""
    ids: dict[str, list[int]] = {}
    done = {}
    for _, fields in published_entries(client, config):
        batch = decode(fields[ENTRY_FIELD], TokenBatch)
        for item in batch.items:
            ids.setdefault(item.rid, []).extend(item.ids)
            if item.finish is not None:
                done[item.rid] = (item.finish.weights_version, batch.worker_id)
    return {rid: (ids[rid], *done[rid]) for rid in done}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-weights")
    a, b = save_checkpoint(root / "a", seed=1), save_checkpoint(root / "b", seed=2)
    return a, b, expected_outputs(a, PROMPTS, MAX_NEW), expected_outputs(b, PROMPTS, MAX_NEW)


def test_every_request_under_an_update_finishes_on_one_version_it_names(
    redis_client, redis_url, checkpoints
):
    a, b, expected_a, expected_b = checkpoints
    redis_client.flushall()
    config = BusConfig(redis_url=redis_url, block_ms=20, heartbeat_interval_s=0.1)
    workers = [Worker(Engine(str(a), dtype="float32"), redis_client, config, w, str(a))
               for w in ("w1", "w2")]  # fmt: skip
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    router = RouterStage(config, redis_client, threading.Event())
    ensure_group(redis_client, router.input_stream(config), router.group)
    router_actor = Actor(redis_client, config, router, threading.Event())
    threads.append(threading.Thread(target=router_actor.run, daemon=True))
    for thread in threads:
        thread.start()
    version_a = initial_version(str(a))
    try:
        _wait(lambda: len(redis_client.smembers(config.workers_key())) == 2)
        record = None
        for i in range(REQUESTS):
            if i == UPDATE_AFTER:
                record = set_weights([(redis_client, config)], str(b))
            job = TokenizedRequest(f"r{i}", "t:reply", PROMPTS[i % len(PROMPTS)],
                                   {**GREEDY, "max_new_tokens": MAX_NEW})  # fmt: skip
            redis_client.xadd(config.tokenized_stream(), {ENTRY_FIELD: encode(job)})
            time.sleep(SEND_EVERY_S)
        _wait(lambda: len(_answers(redis_client, config)) == REQUESTS)
        # Every live worker serves B (or failed to load it: then the history check fails).
        _wait(lambda: read_fleet([(redis_client, config)])["converged"])
    finally:
        router_actor.stop.set()
        for worker in workers:
            worker.stop.set()
        for thread in threads:
            thread.join(timeout=30)

    answers = _answers(redis_client, config)
    assert sorted(answers) == sorted(f"r{i}" for i in range(REQUESTS))  # none lost
    seen = set()
    for i in range(REQUESTS):
        ids, version, worker_id = answers[f"r{i}"]
        expected = {version_a: expected_a, record.version: expected_b}[version]
        assert ids == expected[i % len(PROMPTS)], (i, version, worker_id)
        seen.add(version)
    assert seen == {version_a, record.version}  # the stream did run across the update
    # Under load: a worker had requests running to drain when the update came.
    assert any(worker.weights.history[0].drain_seconds > 0 for worker in workers)
    for worker in workers:
        (update,) = worker.weights.history
        assert update.ok and update.version == record.version
        logger.warning("weights update on worker %s: %.3f s paused (drain %.3f s, load and "
                       "check %.3f s)", worker.worker_id, update.paused_seconds,
                       update.drain_seconds, update.load_seconds)  # fmt: skip
        stream = config.worker_stream(worker.worker_id)
        assert redis_client.xpending(stream, "worker")["pending"] == 0
