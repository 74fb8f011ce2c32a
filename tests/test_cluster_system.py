"""The whole system on a three-primary Redis Cluster: `streamserve up --redis-url <one node>`
finds the cluster by itself and runs a pipeline on each shard, its ingress replicas sharing
one port. Streams, a resume after an ingress's kill -9, an abort and a batch all work
whichever replica (so whichever shard) each HTTP request lands on: requests are found on
the shard they were submitted to, files and batches live on the home shard.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import urllib.request

import pytest
import redis

from runtime.cluster import shard_configs
from runtime.config import BusConfig
from tests.pipeline_harness import (
    Pipeline,
    resume_stream,
    sse_events,
    stream_then_kill_its_ingress,
)
from tests.pipeline_harness import post_on_new_connection as _post
from tests.prometheus_text import total

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 24
BODY = {"model": MODEL, "prompt": "Once upon a time, in a city of streams,", "temperature": 0,
        "max_tokens": MAX_TOKENS, "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def pipeline(cluster):
    # Pointed at the last node: any node will do, the cluster is found from it.
    with Pipeline(MODEL, redis_url=cluster[-1], worker_arg=["--dtype=float32"]) as running:
        yield running


@pytest.fixture(scope="module")
def undisturbed(pipeline):
    response = _post(pipeline, "/v1/completions", BODY)
    assert response.status == 200
    return json.loads(response.read())["choices"][0]["text"]


def test_up_runs_a_pipeline_on_every_shard_and_any_replica_answers_alike(pipeline, undisturbed):
    shards = shard_configs(BusConfig(redis_url=pipeline.redis_url))
    tags = [s.shard for s in shards]
    assert len(tags) == 3
    texts = [json.loads(_post(pipeline, "/v1/completions", BODY).read())["choices"][0]["text"]
             for _ in range(12)]  # fmt: skip
    assert texts == [undisturbed] * 12
    with urllib.request.urlopen(pipeline.url + "/status.json", timeout=30) as reply:
        status = json.loads(reply.read())
    assert [s["shard"] for s in status["shards"]] == tags
    assert all(s["workers"] == 1 and s["redis"]["commands_processed"] > 0
               for s in status["shards"])  # fmt: skip
    assert sorted(w["shard"] for w in status["workers"]) == sorted(tags)
    # Every shard's names live on its own primary, under its hash tag.
    for shard in shards:
        client = redis.Redis.from_url(shard.redis_url)
        names = [name.decode() for name in client.scan_iter(count=1000)]
        assert names and all(f":{{{shard.shard}}}:" in name for name in names), names[:5]
        client.close()
    # Requests landed on more than one shard, and the metrics say which.
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(pipeline.url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        served = [total(text, "streamserve:generation_tokens_total", shard=s.shard)
                  for s in shards]  # fmt: skip
        if sum(1 for tokens in served if tokens) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sum(1 for tokens in served if tokens) >= 2, served
    figures = subprocess.run(
        [sys.executable, "-m", "cli", "status", "--once", "--json",
         "--redis-url", pipeline.redis_url],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert [s["shard"] for s in json.loads(figures)["shards"]] == tags


def test_a_stream_whose_ingress_is_killed_resumes_on_any_replica(pipeline, undisturbed):
    body = {**BODY, "stream": True}
    text, last_id = stream_then_kill_its_ingress(pipeline, "/v1/completions", body)
    response = resume_stream(pipeline, "/v1/completions", body, last_id)
    events = list(sse_events(response))
    assert events[-1][1] == "[DONE]"
    text += "".join(json.loads(data)["choices"][0]["text"] for _, data in events[:-1])
    assert text == undisturbed


def test_an_abort_finds_its_request_whichever_replica_gets_it(pipeline):
    body = {**BODY, "stream": True, "max_tokens": 2000}
    events = sse_events(_post(pipeline, "/v1/completions", body))
    request_id = json.loads(next(events)[1])["id"]
    for _ in range(6):  # several connections: likely some to another shard's replica
        response = _post(pipeline, f"/v1/abort/{request_id}", {})
        answer = json.loads(response.read())
        assert response.status in (200, 404), answer
        if response.status == 404:  # aborted by an earlier call: the request has ended
            break
    finishes = [json.loads(data)["choices"][0]["finish_reason"]
                for _, data in events if data != "[DONE]"]  # fmt: skip
    assert finishes[-1] == "abort"


def test_a_batch_runs_on_the_cluster_and_its_files_are_seen_from_every_replica(pipeline):
    import openai

    client = openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {**BODY, "max_tokens": 4}} for i in range(4)]  # fmt: skip
    data = "\n".join(json.dumps(line) for line in lines).encode() + b"\n"
    upload = client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    for _ in range(4):  # new connections each time (the client keeps one alive: close it)
        fresh = openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)
        assert fresh.files.retrieve(upload.id).bytes == len(data)
        fresh.close()
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 0)
    results = [json.loads(line) for line in client.files.content(batch.output_file_id).text
               .splitlines()]  # fmt: skip
    assert sorted(r["custom_id"] for r in results) == [f"line-{i}" for i in range(4)]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_direct_clients_spread_over_the_shards_and_answer_alike(pipeline, undisturbed):
    from bus.client import Client

    sampling = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
    shards = set()
    # The shard is drawn at random among those with a worker (all three here): six clients
    # would all draw one shard once in 243 runs, so draw until two differ (40 clients all
    # on one shard: 3^-39). Each client that lands on a shard not seen yet generates there.
    for _ in range(40):
        with Client(pipeline.redis_url) as client:  # any node's URL
            assert client.home_config.shard == shard_configs(client.config)[0].shard
            if client.config.shard in shards:
                continue
            shards.add(client.config.shard)
            assert client.generate(BODY["prompt"], sampling=sampling)["text"] == undisturbed
        if len(shards) >= 2:
            break
    assert len(shards) >= 2
