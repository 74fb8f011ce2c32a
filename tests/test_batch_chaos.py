"""Chaos for batches: while a 300-line batch runs, kill -9 a worker, the ingress whose runner
holds the batch, a router, and Redis itself (started again from its append-only file). The
batch completes with every line answered exactly once, and a line's answer is the one the
same request gets alone (greedy, float32).
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import openai
import pytest
import redis

from batch_store.batches import BatchStore
from runtime.embedded_server import EmbeddedRedis
from tests.pipeline_harness import QUICK_RECOVERY_ENV, Pipeline

pytestmark = pytest.mark.slow

LINES = 300
MAX_TOKENS = 4
# (what to kill, once this many lines have their result)
KILLS = [("gpu_worker", 30), ("runner", 80), ("stage router", 130), ("redis", 180)]


def line(i: int) -> dict:
    body = {"model": "smollm2-135m-instruct", "prompt": f"Item {i}: the colour of the sea is",
            "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with EmbeddedRedis(data_dir=tmp_path_factory.mktemp("redis-data")) as running:
        yield running


@pytest.fixture(scope="module")
def pipeline(server):
    env = {**QUICK_RECOVERY_ENV, "STREAMSERVE_BATCH_LEASE_S": "2"}
    replicas = {"ingress": 2, "routers": 2, "workers": 2}
    with Pipeline(env=env, redis_url=server.url, worker_arg=["--dtype=float32"],
                  **replicas) as running:  # fmt: skip
        yield running


def _runner_pid(store: BatchStore, batch_id: str) -> int:
    """The ingress whose runner holds the batch: its lease names it (host-pid-suffix)."""
    deadline = time.monotonic() + 20
    while (owner := store.client.get(store.key(batch_id, "lease"))) is None:
        assert time.monotonic() < deadline, "no runner took the batch"
        time.sleep(0.1)
    _, pid, _, _ = owner.decode().rsplit("-", 3)
    return int(pid)


def _kill(pipeline: Pipeline, server: EmbeddedRedis, store: BatchStore, what: str, batch_id):
    if what == "redis":
        time.sleep(1.2)  # appendfsync everysec: what is older than a second is on disk
        server.kill()
        time.sleep(0.5)
        server.revive()
    elif what == "runner":
        os.kill(_runner_pid(store, batch_id), signal.SIGKILL)
    else:
        os.kill(pipeline.replica_pids(what)[0], signal.SIGKILL)


def test_a_batch_completes_every_line_once_through_kills_of_every_kind(pipeline, server):
    client = openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=5)
    content = "\n".join(json.dumps(line(i)) for i in range(LINES)).encode()
    upload = client.files.create(file=("chaos.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    store = BatchStore(redis.Redis.from_url(server.url), pipeline.config)
    kills = list(KILLS)
    deadline = time.monotonic() + 600
    while True:
        try:
            state = store.get(batch.id)
        except (redis.ConnectionError, redis.TimeoutError):
            state = None  # Redis is being revived
        if state is not None:
            if state["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            done = state["request_counts"]["completed"] + state["request_counts"]["failed"]
            if kills and done >= kills[0][1]:
                _kill(pipeline, server, store, kills.pop(0)[0], batch.id)
        assert time.monotonic() < deadline, f"the batch did not finish: {state}"
        time.sleep(0.2)
    assert not kills, f"the batch ended before these kills: {kills}"
    assert state["status"] == "completed", state
    assert state["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    out = [json.loads(raw) for raw in store.files.content(state["output_file_id"]).splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"line-{i}" for i in range(LINES))
    assert all(o["response"]["status_code"] == 200 for o in out)
    by_id = {o["custom_id"]: o["response"]["body"] for o in out}
    for i in (0, 100, 299):  # the same answer as the request alone
        alone = client.completions.create(**line(i)["body"])
        assert by_id[f"line-{i}"]["choices"][0]["text"] == alone.choices[0].text
