"""Ingress replicas attached to different shards of a Redis Cluster act as one deployment:
a request is found (aborted, resumed) through any replica, files and stored responses live
on the home shard for all of them, and /status.json and /metrics cover every shard.
"""

from __future__ import annotations

import json

import pytest
import redis

from jobs.protocol import ENTRY_FIELD, encode
from runtime.cluster import shard_configs
from runtime.config import BusConfig
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas, post_raw
from tests.prometheus_text import total

DEAD = "ingress-deadhost-1-abcdef"
PIECES = [("Once", [1]), (" upon", [2, 3]), (" a", [4]), (" time", [5])]


@pytest.fixture(scope="module")
def shards(cluster):
    configs = shard_configs(BusConfig(redis_url=cluster[1]))
    clients = [redis.Redis.from_url(c.redis_url) for c in configs]
    for client, config in zip(clients, configs, strict=True):
        add_worker(client, config, f"w-{config.shard}")
    yield list(zip(clients, configs, strict=True))
    for client in clients:
        client.close()


@pytest.fixture(scope="module")
def replicas(shards):
    """An ingress on s1 and one on s2: neither on the home shard."""
    (_, _), (_, s1), (_, s2) = shards
    with RunningIngress(s1.redis_url, s1) as first, RunningIngress(s2.redis_url, s2) as second:
        yield first, second


def test_a_stream_submitted_on_one_shard_resumes_through_a_replica_on_another(shards, replicas):
    (_, _), (client, s1), _ = shards
    client.set(s1.request_key("cmpl-c1"), 1)  # what a dead replica on s1 leaves behind
    for delta in deltas("cmpl-c1-0", PIECES):
        client.xadd(s1.reply_stream(DEAD), {ENTRY_FIELD: encode(delta)})
    body = {"model": MODEL, "prompt": "Tell me", "stream": True}
    status, data = post_raw(replicas[1].url + "/v1/completions", body,
                            {"Last-Event-ID": f"cmpl-c1/{DEAD}/1"})  # fmt: skip
    assert status == 200, data
    texts = [json.loads(event.split("data: ", 1)[1])["choices"][0]["text"]
             for event in data.decode().split("\n\n") if "data: {" in event]  # fmt: skip
    assert "".join(texts) == " upon a time"


def test_an_abort_reaches_a_request_submitted_on_another_shard(shards, replicas):
    (_, _), _, (client, s2) = shards
    client.set(s2.request_key("cmpl-c2"), 2)
    status, answer = replicas[0].post("/v1/abort/cmpl-c2", {})
    assert (status, answer["aborted"]) == (200, 2)
    # Flagged on the shard that holds them, whose workers read the flags (bus/aborts.py).
    assert client.exists(s2.abort_key("cmpl-c2-0"), s2.abort_key("cmpl-c2-1")) == 2
    status, answer = replicas[0].post("/v1/abort/cmpl-unknown", {})
    assert (status, answer["error"]["code"]) == (404, "request_not_found")


def test_a_prompt_of_token_ids_goes_to_the_router_stream_of_its_replicas_shard(shards, replicas):
    (_, _), _, (client, s2) = shards
    before = client.xlen(s2.tokenized_stream())
    with Upstream(s2.redis_url, s2, lambda request: deltas(request.rid, PIECES)) as upstream:
        status, answer = replicas[1].post("/generate", {"input_ids": [7, 8, 9]})
    assert status == 200 and answer["text"] == "Once upon a time", answer
    assert upstream.routed == [answer["meta_info"]["id"]]  # read on s2's tokenized stream
    assert client.xlen(s2.tokenized_stream()) == before + 1
    assert f":{{{s2.shard}}}:" in s2.tokenized_stream()  # a name on s2's own slot


def test_files_live_on_the_home_shard_for_every_replica(shards, replicas):
    import openai

    first, second = (openai.OpenAI(base_url=r.url + "/v1", api_key="unused") for r in replicas)
    upload = first.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    assert second.files.retrieve(upload.id).bytes == 3
    assert [f.id for f in second.files.list()] == [upload.id]
    (home, home_config), *others = shards
    assert home.exists(home_config.key_name("file", upload.id))
    for client, _ in others:  # nothing of the file elsewhere
        assert not any(upload.id.encode() in name for name in client.scan_iter(count=1000))


def test_responses_live_on_the_home_shard_for_every_replica(shards, replicas):
    import openai

    (home, home_config), (_, s1), (_, s2) = shards

    def script(request):
        return deltas(request.rid, PIECES)

    with Upstream(s1.redis_url, s1, script), Upstream(s2.redis_url, s2, script) as second_up:
        first, second = (openai.OpenAI(base_url=r.url + "/v1", api_key="-") for r in replicas)
        made = first.responses.create(model=MODEL, input="Hi")
        assert second.responses.retrieve(made.id).output_text == "Once upon a time"
        second.responses.create(model=MODEL, input="Again", previous_response_id=made.id)
        assert [m["content"] for m in second_up.requests[-1].messages] == [
            "Hi", "Once upon a time", "Again"]  # fmt: skip
    assert home.exists(home_config.key_name("response", made.id))


def test_status_and_metrics_cover_every_shard(shards, replicas):
    status, _, data = replicas[0].request("GET", "/status.json")
    assert status == 200
    picture = json.loads(data)
    tags = [config.shard for _, config in shards]
    assert [s["shard"] for s in picture["shards"]] == tags
    assert all(s["redis"]["commands_processed"] > 0 for s in picture["shards"])
    assert sorted(w["id"] for w in picture["workers"]) == sorted(f"w-{tag}" for tag in tags)
    status, _, data = replicas[1].request("GET", "/metrics")
    text = data.decode()
    for shard in tags:
        assert total(text, "streamserve:live_workers", shard=shard) == 1
        assert total(text, "streamserve:redis_commands_processed_total", shard=shard) > 0
