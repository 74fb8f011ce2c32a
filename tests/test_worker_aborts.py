"""An abort is a flag the worker holding the job reads (bus/aborts.py), on a real server with a
real worker loop (the synthetic engine: no model): a running job ends with "abort" within the
check interval, whoever flagged it and with nothing recording where it ran; the checks cost
one MGET per interval for all the worker's jobs, not a command per job or per publish."""

from __future__ import annotations

import time

import msgpack
import pytest
import redis

from bus.aborts import aborts_stream, publish_aborts
from gpu_worker.synthetic_engine import SyntheticEngine
from gpu_worker.worker import Worker
from jobs.protocol import ENTRY_FIELD, TokenBatch, TokenizedRequest, decode, encode
from runtime.cluster import shard_configs
from runtime.config import BusConfig
from tests.worker_thread import published_entries, running, wait_until

MODEL = "smollm2-135m-instruct"
STEP_MS = 10.0
MAX_NEW = 2_000  # 20 s of steps: only an abort ends it within the test


@pytest.fixture
def config(request, redis_url) -> BusConfig:
    options = {"abort_check_interval_ms": 200, **getattr(request, "param", {})}
    return BusConfig(redis_url=redis_url, block_ms=20, publish_interval_ms=20, **options)


@pytest.fixture
def worker(redis_client, config):
    engine = SyntheticEngine(MODEL, step_ms=STEP_MS, batch=8)
    with running(Worker(engine, redis_client, config, "w", MODEL), redis_client, config) as w:
        yield w


def _route(client: redis.Redis, config: BusConfig, *rids: str) -> None:
    """As the router forwards a job: onto the worker's stream, nothing else."""
    for rid in rids:
        job = TokenizedRequest(rid, "t:reply", [5, 17, 99], {"max_new_tokens": MAX_NEW,
                                                              "ignore_eos": True})  # fmt: skip
        client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})


def _finishes(client: redis.Redis, config: BusConfig) -> dict[str, tuple[str, int]]:
    """rid -> (finish reason, output ids published) of the jobs that ended."""
    published: dict[str, int] = {}
    ended = {}
    for _, fields in published_entries(client, config):
        for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
            published[item.rid] = item.start + len(item.ids)
            if item.finish is not None:
                ended[item.rid] = (item.finish.reason, published[item.rid])
    return ended


def _calls(client: redis.Redis, name: str) -> int:
    return client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)


def test_a_flag_ends_a_running_job_within_the_check_interval(redis_client, config, worker):
    _route(redis_client, config, "r1", "r2")
    wait_until(lambda: {"r1", "r2"} <= set(worker.jobs))
    wait_until(lambda: worker.jobs["r1"].reported > 0)
    publish_aborts(redis_client, config, ["r1"])  # as the ingress or any client does
    took = wait_until(lambda: "r1" in _finishes(redis_client, config))
    assert took < config.abort_check_interval_ms / 1000 + 0.5
    reason, published = _finishes(redis_client, config)["r1"]
    assert reason == "abort" and published < MAX_NEW
    assert "r2" in worker.jobs and "r2" not in _finishes(redis_client, config)  # untouched
    assert not redis_client.keys("*route*")  # nothing recorded where the jobs ran


def test_a_job_flagged_on_its_way_is_dropped_on_arrival(redis_client, config, worker):
    publish_aborts(redis_client, config, ["early"])
    _route(redis_client, config, "early")
    wait_until(lambda: "early" in _finishes(redis_client, config))
    assert _finishes(redis_client, config)["early"] == ("abort", 0)
    assert redis_client.xpending(config.worker_stream("w"), "worker")["pending"] == 0


def test_the_checks_cost_one_small_read_per_interval_for_all_the_jobs(redis_client, config, worker):
    _route(redis_client, config, *(f"r{i}" for i in range(8)))
    wait_until(lambda: len(worker.jobs) == 8)
    redis_client.config_resetstat()
    time.sleep(1.0)
    # A commit's log entry: an XADD, in a script or alone (bus/fenced_stream.py).
    reads, commits = _calls(redis_client, "xread"), _calls(redis_client, "xadd")
    # ~50 publishes of 8 jobs in the second; the aborts stream read 5 times, one XREAD
    # each, which names no job: its bytes do not grow with the jobs held.
    assert commits >= 10
    assert 3 <= reads <= 1.0 / (config.abort_check_interval_ms / 1000) + 1
    assert _calls(redis_client, "mget") == 0  # no flag read but on arrival


def test_a_malformed_aborts_entry_is_skipped_and_the_next_abort_still_ends_its_job(
    redis_client, config, worker
):
    _route(redis_client, config, "r1", "r2")
    wait_until(lambda: {"r1", "r2"} <= set(worker.jobs))
    stream = aborts_stream(config)
    for fields in ({"rids": b"\xc1"}, {"rids": msgpack.packb({"r2": 1})}, {"other": "r2"},
                   {"rids": msgpack.packb([1, 2])}):  # fmt: skip
        redis_client.xadd(stream, fields)
    publish_aborts(redis_client, config, ["r1"])
    wait_until(lambda: "r1" in _finishes(redis_client, config))
    assert "r2" in worker.jobs and "r2" not in _finishes(redis_client, config)


@pytest.mark.parametrize("config", [{"abort_check_interval_ms": 60_000}], indirect=True)
def test_a_worker_told_on_its_stream_ends_the_job_within_a_step(redis_client, config, worker):
    """The ingress serving a request knows its worker from its first delta: told on the
    worker's stream, the job ends with the worker's next read, not its next flag check
    (a minute here)."""
    _route(redis_client, config, "r1", "r2")
    wait_until(lambda: worker.jobs.get("r1") is not None and worker.jobs["r1"].reported > 0)
    publish_aborts(redis_client, config, ["r1"], workers={"r1": "w"})
    took = wait_until(lambda: "r1" in _finishes(redis_client, config))
    assert took < 1.0
    assert _finishes(redis_client, config)["r1"][0] == "abort"
    assert "r2" in worker.jobs  # untouched


def test_an_abort_names_no_stream_it_would_create_or_break(redis_client, config):
    """A worker gone (no stream) gets none recreated; a name that is no worker id, or a key
    of another type under a worker stream's name, leaves those jobs to their flags."""
    redis_client.set(config.worker_stream("clash"), "not a stream")
    workers = {"a": "gone", "b": "no id!", "c": "clash"}
    publish_aborts(redis_client, config, ["a", "b", "c"], workers=workers)
    assert not redis_client.exists(config.worker_stream("gone"))
    assert all(redis_client.exists(config.abort_key(rid)) for rid in "abc")


def test_on_a_cluster_shard_its_aborts_stream_ends_a_running_job(nodes):
    """The worker's commit script reads its shard's aborts stream: one slot with its other
    names (the shard's hash tag), on the primary that owns it."""
    base = BusConfig(redis_url=nodes[0], block_ms=20, publish_interval_ms=20,
                     abort_check_interval_ms=200)  # fmt: skip
    shard = shard_configs(base)[1]
    client = redis.Redis.from_url(shard.redis_url)
    engine = SyntheticEngine(MODEL, step_ms=STEP_MS, batch=8)
    with running(Worker(engine, client, shard, "w", MODEL), client, shard) as worker:
        _route(client, shard, "r1", "r2")
        wait_until(lambda: worker.jobs.get("r1") is not None and worker.jobs["r1"].reported > 0)
        publish_aborts(client, shard, ["r1"])
        wait_until(lambda: "r1" in _finishes(client, shard))
        assert _finishes(client, shard)["r1"][0] == "abort" and "r2" in worker.jobs
    client.close()
