"""Online weight updates on a real worker (in-process, on the real server): from checkpoint A
to B its answers are a fresh engine's on B and name B's version, its prefix cache holds
nothing from A, a request running when the update came finishes on A, and weights that do
not fit (a wrong shape, another shape, a missing path, a record written badly) leave it
serving what it served, with the reason in its heartbeat."""

from __future__ import annotations

import pytest
import redis

from bus.weights_admin import read_fleet, set_weights
from gpu_worker import Engine
from gpu_worker.cli import _engine_on_fleet_weights
from gpu_worker.worker import Worker
from jobs.protocol import (
    ENTRY_FIELD,
    Abort,
    Heartbeat,
    TokenBatch,
    TokenizedRequest,
    decode,
    encode,
)
from jobs.weights import initial_version, weights_key
from runtime.config import BusConfig
from tests.weights_checkpoints import (
    GREEDY,
    expected_outputs,
    save_checkpoint,
    save_wrong_shape,
)
from tests.worker_thread import published_entries, running, wait_until

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12] * 5, [9, 8, 7, 6, 5, 4, 3, 2, 1] * 4]
MAX_NEW = 12
LONG = 900  # a request still running when the update comes (seconds on a CPU)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    a, b = save_checkpoint(root / "a", seed=1), save_checkpoint(root / "b", seed=2)
    return {
        "a": a,
        "b": b,
        "wrong_shape": save_wrong_shape(root / "wrong-shape", like=a),
        "other_shape": save_checkpoint(root / "other-shape", seed=3, intermediate_size=96),
        "expected": {
            name: expected_outputs(path, PROMPTS, MAX_NEW) for name, path in (("a", a), ("b", b))
        },  # fmt: skip
        "long_a": expected_outputs(a, PROMPTS[:1], LONG)[0],
    }


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, heartbeat_interval_s=0.1)


@pytest.fixture
def worker_on_a(redis_client, config, checkpoints):
    redis_client.flushall()
    model = str(checkpoints["a"])
    worker = Worker(Engine(model, dtype="float32"), redis_client, config, "w1", model)
    with running(worker, redis_client, config):
        yield worker


def _send(client: redis.Redis, config: BusConfig, rid: str, prompt: list[int], new: int) -> None:
    job = TokenizedRequest(rid, "t:reply", prompt, {**GREEDY, "max_new_tokens": new})
    client.xadd(config.worker_stream("w1"), {ENTRY_FIELD: encode(job)})


def _answers(client: redis.Redis, config: BusConfig) -> dict[str, tuple[list[int], str | None]]:
    """rid -> (output ids, the weights version its Finish names), of the finished jobs."""
    ids: dict[str, list[int]] = {}
    versions = {}
    for _, fields in published_entries(client, config):
        for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
            ids.setdefault(item.rid, []).extend(item.ids)
            if item.finish is not None:
                versions[item.rid] = item.finish.weights_version
    return {rid: (ids[rid], version) for rid, version in versions.items()}


def _run(client, config, rid, prompt, new=MAX_NEW) -> tuple[list[int], str | None]:
    _send(client, config, rid, prompt, new)
    wait_until(lambda: rid in _answers(client, config))
    return _answers(client, config)[rid]


def _beat(client: redis.Redis, config: BusConfig) -> Heartbeat:
    return decode(client.get(config.heartbeat_key("w1")), Heartbeat)


def test_an_update_serves_the_new_weights_and_keeps_nothing_of_the_old(
    redis_client, config, checkpoints, worker_on_a
):
    version_a = initial_version(str(checkpoints["a"]))
    assert _run(redis_client, config, "a0", PROMPTS[0]) == (checkpoints["expected"]["a"][0],
                                                             version_a)  # fmt: skip
    cache = worker_on_a.scheduler.kv.prefix_cache
    assert cache.total_size() > 0  # A's KV of the prompt is cached

    record = set_weights([(redis_client, config)], str(checkpoints["b"]))
    wait_until(lambda: _beat(redis_client, config).weights_version == record.version)
    assert cache.total_size() == 0  # nothing computed with A's weights is left
    # The same prompt again: B's answer, computed afresh (a hit on A's KV would differ).
    for i, prompt in enumerate(PROMPTS):
        assert _run(redis_client, config, f"b{i}", prompt) == (checkpoints["expected"]["b"][i],
                                                               record.version)  # fmt: skip
    update = worker_on_a.weights.history[-1]
    assert update.ok and update.version == record.version and update.paused_seconds > 0
    beat = _beat(redis_client, config)
    assert beat.weights_error is None and beat.weights_target is None
    assert beat.model == str(checkpoints["b"])  # what it serves, as /status shows it
    view = read_fleet([(redis_client, config)])
    assert view["converged"] and view["workers"][0]["version"] == record.version


def test_a_running_request_finishes_on_the_old_weights_and_a_later_one_runs_on_the_new(
    redis_client, config, checkpoints, worker_on_a
):
    version_a = initial_version(str(checkpoints["a"]))
    _send(redis_client, config, "long", PROMPTS[0], LONG)
    wait_until(lambda: worker_on_a.jobs)  # running
    record = set_weights([(redis_client, config)], str(checkpoints["b"]))
    # Noticed, and draining: the job sent now waits for the new weights.
    wait_until(lambda: _beat(redis_client, config).weights_target == record.version)
    assert "long" not in _answers(redis_client, config)  # the drain has something to wait for
    _send(redis_client, config, "after", PROMPTS[1], MAX_NEW)
    wait_until(lambda: {"long", "after"} <= set(_answers(redis_client, config)))
    answers = _answers(redis_client, config)
    assert answers["long"] == (checkpoints["long_a"], version_a)
    assert answers["after"] == (checkpoints["expected"]["b"][1], record.version)
    assert worker_on_a.weights.history[-1].drain_seconds > 0


def test_an_abort_during_the_drain_stops_the_running_request_and_the_update_goes_on(
    redis_client, config, checkpoints, worker_on_a
):
    _send(redis_client, config, "long", PROMPTS[0], LONG)
    wait_until(lambda: worker_on_a.jobs)
    record = set_weights([(redis_client, config)], str(checkpoints["b"]))
    wait_until(lambda: _beat(redis_client, config).weights_target == record.version)
    _send(redis_client, config, "after", PROMPTS[1], MAX_NEW)  # waits for B, pending
    redis_client.xadd(config.worker_stream("w1"), {ENTRY_FIELD: encode(Abort("long"))})
    wait_until(lambda: {"long", "after"} <= set(_answers(redis_client, config)))
    ids, version = _answers(redis_client, config)["long"]
    assert len(ids) < LONG and ids == checkpoints["long_a"][: len(ids)]  # stopped, on A
    assert version == initial_version(str(checkpoints["a"]))
    assert _answers(redis_client, config)["after"] == (checkpoints["expected"]["b"][1],
                                                       record.version)  # fmt: skip
    assert redis_client.xpending(config.worker_stream("w1"), "worker")["pending"] == 0


@pytest.mark.parametrize("bad", ["wrong_shape", "other_shape", "missing"])
def test_weights_that_do_not_fit_leave_the_worker_serving_the_old_with_the_reason(
    redis_client, config, checkpoints, worker_on_a, bad
):
    source = str(checkpoints["a"].parent / "no-such-checkpoint") if bad == "missing" else str(
        checkpoints[bad])  # fmt: skip
    record = set_weights([(redis_client, config)], source)
    wait_until(lambda: (_beat(redis_client, config).weights_error or "").startswith(record.version))
    beat = _beat(redis_client, config)
    assert beat.weights_version == initial_version(str(checkpoints["a"]))
    reason = {"wrong_shape": "shape (127, 64), expected (128, 64)",
              "other_shape": "intermediate_size 96, serving 128",
              "missing": "cannot load"}[bad]  # fmt: skip
    assert reason in beat.weights_error, beat.weights_error
    # Still serving A, and not trying the same version again.
    assert _run(redis_client, config, "a1", PROMPTS[1]) == (
        checkpoints["expected"]["a"][1],
        initial_version(str(checkpoints["a"])),
    )
    assert len(worker_on_a.weights.history) == 1 and not worker_on_a.weights.history[0].ok
    view = read_fleet([(redis_client, config)])
    assert view["converged"] and view["workers"][0]["error"] == beat.weights_error


def test_a_record_written_badly_by_hand_is_reported_and_ends_nothing(
    redis_client, config, checkpoints, worker_on_a
):
    redis_client.hset(weights_key(config), mapping={"source": str(checkpoints["b"])})  # no version
    wait_until(lambda: "no source or version" in (_beat(redis_client, config).weights_error or ""))
    assert _run(redis_client, config, "a2", PROMPTS[0])[0] == checkpoints["expected"]["a"][0]


def test_a_worker_started_after_an_update_loads_the_new_version(redis_client, config, checkpoints):
    redis_client.flushall()
    record = set_weights([(redis_client, config)], str(checkpoints["b"]))
    options = {"dtype": "float32"}
    engine, model, weights = _engine_on_fleet_weights(config, str(checkpoints["a"]), options, "w9")
    assert (model, weights.version, weights.error) == (str(checkpoints["b"]), record.version, None)
    got = engine.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
    assert [r["output_ids"] for r in got] == checkpoints["expected"]["b"]
    # Where the record's weights do not load, it serves its --model and says why.
    bad = set_weights([(redis_client, config)], str(checkpoints["other_shape"]) + "-gone")
    engine, model, weights = _engine_on_fleet_weights(config, str(checkpoints["a"]), options, "w9")
    assert model == str(checkpoints["a"]) and weights.version == initial_version(model)
    assert weights.error.startswith(bad.version) and weights.due() is None


def _record(version: str, source: str = "/ckpt") -> dict[bytes, bytes]:
    return {b"source": source.encode(), b"version": version.encode(), b"serial": b"1"}


def test_an_update_is_due_until_applied_and_a_failed_version_is_not_tried_again(checkpoints):
    from gpu_worker.synthetic_engine import SyntheticEngine
    from gpu_worker.weights_update import WeightsUpdates

    weights = WeightsUpdates("w", "w0-aaaa")
    assert weights.due() is None and weights.target is None  # no record: serve on
    weights.noticed(_record("w0-aaaa"))
    assert weights.due() is None  # the version it serves
    weights.noticed(_record("w1-bbbb"))
    assert weights.due().version == "w1-bbbb" and weights.target == "w1-bbbb"
    # Asked back to what it serves before the drain ended: nothing to do, nothing paused.
    weights.noticed(_record("w0-aaaa"))
    assert weights.due() is None and weights.target is None
    weights.noticed(_record("w2-cccc"))
    update = weights.apply(SyntheticEngine(str(checkpoints["a"])), weights.due())
    assert not update.ok and "no weights to update" in update.error
    assert weights.version == "w0-aaaa" and weights.error.startswith("w2-cccc: ")
    assert weights.due() is None and weights.target is None  # not tried again
    weights.noticed({b"source": b"/x"})  # written by hand, no version: reported, ignored
    assert "no source or version" in weights.error and weights.due() is None
