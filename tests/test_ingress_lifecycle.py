"""Health, metrics and what happens when a client leaves: the ingress on the real Redis."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from jobs.protocol import ENTRY_FIELD, Abort, GenerateRequest, decode
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas
from tests.prometheus_text import samples, total


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url) as server:
        yield server


def test_health_is_503_without_a_worker_heartbeat_and_200_with_one(ingress, redis_client):
    status, _, data = ingress.request("GET", "/health")
    assert status == 503 and json.loads(data)["error"]["code"] == "no_worker"
    redis_client.sadd(ingress.config.workers_key(), "gone")  # listed, but its beat expired
    status, _, _ = ingress.request("GET", "/health")
    assert status == 503
    add_worker(redis_client, ingress.config, "w1")
    status, _, data = ingress.request("GET", "/health")
    # A heartbeat from before workers announced their attention path: null.
    assert status == 200 and json.loads(data) == {
        "status": "ok",
        "workers": 1,
        "serving": {"w1": None},
    }


def test_metrics_count_requests_and_latencies(ingress, redis_client):
    add_worker(redis_client, ingress.config)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    script = lambda r: deltas(r.rid, [("a", [1]), ("b", [2, 3])], prompt_tokens=4)  # noqa: E731
    with Upstream(ingress.config.redis_url, ingress.config, script):
        assert ingress.post("/v1/chat/completions", body)[0] == 200
        assert ingress.request("POST", "/v1/chat/completions", {**body, "stream": True})[0] == 200
    assert ingress.post("/v1/chat/completions", {**body, "n": 0})[0] == 400
    status, headers, data = ingress.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = data.decode()
    p, chat = "streamserve:", {"endpoint": "/v1/chat/completions", "role": "ingress"}
    assert total(text, f"{p}requests_total", **chat, status="200") == 2
    assert total(text, f"{p}requests_total", **chat, status="400") == 1
    assert total(text, f"{p}requests_in_flight") == 1  # this very /metrics request
    assert total(text, f"{p}live_workers") == 1
    assert total(text, f"{p}time_to_first_token_seconds_count") == 2
    assert total(text, f"{p}time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert total(text, f"{p}inter_token_latency_seconds_count") == 4  # 2 after the first, x2
    assert total(text, f"{p}e2e_request_latency_seconds_count") == 2
    buckets = [
        v for name, _, v in samples(text) if name == f"{p}inter_token_latency_seconds_bucket"
    ]
    assert buckets == sorted(buckets)
    # The streams the deployment reads, with each group's lag and pending.
    assert total(text, f"{p}stream_length", stream=ingress.config.requests_stream()) is not None


def _running(request: GenerateRequest):
    """A script: each job has produced one token and goes on generating."""
    return [deltas(request.rid, [("Once", [1]), (" upon", [2])])[0]]


def test_a_client_that_disconnects_gets_its_request_aborted(ingress, redis_client):
    add_worker(redis_client, ingress.config)
    config = ingress.config
    with Upstream(config.redis_url, config, _running) as up:
        connection = http.client.HTTPConnection("127.0.0.1", ingress.port, timeout=5)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        connection.request("POST", "/v1/chat/completions", json.dumps(body),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        assert response.status == 200
        received = b""
        while b"Once" not in received:  # the role chunk and the first text, in one send or two
            received += response.read1()
        connection.close()
        deadline = time.monotonic() + 2
        [request] = up.requests
        while not redis_client.exists(config.abort_key(request.rid)):
            assert time.monotonic() < deadline, "no abort after the client left"
            time.sleep(0.02)
    # The flag is the whole abort: the worker running the job reads it (bus/aborts.py).
    assert not redis_client.exists(config.worker_stream("w1"))
    assert 0 < redis_client.ttl(config.abort_key(request.rid)) <= config.reply_ttl_s


def _running_on_w1(request: GenerateRequest):
    """As _running, the first delta naming its worker as the detokenizer copies it."""
    first = deltas(request.rid, [("Once", [1]), (" upon", [2])])[0]
    first.worker = "w1"
    return [first]


def test_the_worker_a_first_delta_named_is_told_when_the_client_leaves(ingress, redis_client):
    add_worker(redis_client, ingress.config)
    config = ingress.config
    redis_client.xgroup_create(config.worker_stream("w1"), "worker", mkstream=True)
    with Upstream(config.redis_url, config, _running_on_w1) as up:
        connection = http.client.HTTPConnection("127.0.0.1", ingress.port, timeout=5)
        body = {"model": MODEL, "prompt": "Hi", "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        received = b""
        while b"Once" not in received:
            received += response.read1()
        connection.close()
        [request] = up.requests
        deadline = time.monotonic() + 2
        while not redis_client.xlen(config.worker_stream("w1")):
            assert time.monotonic() < deadline, "the worker was not told"
            time.sleep(0.02)
    entries = redis_client.xrange(config.worker_stream("w1"))
    assert [decode(fields[ENTRY_FIELD], Abort).rid for _, fields in entries] == [request.rid]
    assert redis_client.exists(config.abort_key(request.rid))  # and flagged, as always


def test_any_client_can_abort_a_running_request_by_its_id(ingress, redis_client):
    add_worker(redis_client, ingress.config)
    config = ingress.config
    with Upstream(config.redis_url, config, _running) as up:
        connection = http.client.HTTPConnection("127.0.0.1", ingress.port, timeout=5)
        body = {"model": MODEL, "prompt": ["a", "b"], "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        first = json.loads(response.readline().removeprefix(b"data: "))  # no id: line asked
        status, answer = ingress.post(f"/v1/abort/{first['id']}", {})
        assert (status, answer["aborted"]) == (200, 2)
        rids = sorted(request.rid for request in up.requests)
        assert rids == [f"{first['id']}-0", f"{first['id']}-1"]
        assert all(redis_client.exists(config.abort_key(rid)) for rid in rids)
        connection.close()


def test_aborting_an_unknown_or_finished_request_is_a_404(ingress, redis_client):
    add_worker(redis_client, ingress.config)
    status, answer = ingress.post("/v1/abort/cmpl-nosuch", {})
    assert (status, answer["error"]["code"]) == (404, "request_not_found")
    body = {"model": MODEL, "prompt": "a"}
    with Upstream(ingress.config.redis_url, ingress.config, lambda r: deltas(r.rid, [("a", [1])])):
        status, answer = ingress.post("/v1/completions", body)
    assert status == 200
    time.sleep(0.05)  # the request's key is deleted from a task right after the reply
    status, answer = ingress.post(f"/v1/abort/{answer['id']}", {})
    assert (status, answer["error"]["code"]) == (404, "request_not_found")


def test_a_finished_request_is_not_aborted(ingress, redis_client):
    add_worker(redis_client, ingress.config)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2}
    with Upstream(ingress.config.redis_url, ingress.config, lambda r: deltas(r.rid, [("a", [1])])):
        assert ingress.post("/v1/chat/completions", body)[0] == 200
    time.sleep(0.05)  # an abort would be published from a task right after the reply
    assert not redis_client.keys(ingress.config.abort_key("*"))


def test_the_reply_stream_is_deleted_on_shutdown(redis_client, redis_url):
    with RunningIngress(redis_url) as ingress:
        add_worker(redis_client, ingress.config)
        stream = ingress.state.reply_stream
        script = lambda r: deltas(r.rid, [("a", [1])])  # noqa: E731
        with Upstream(redis_url, ingress.config, script):
            ingress.post("/generate", {"text": "x"})
        assert redis_client.exists(stream)
    assert not redis_client.exists(stream)


def test_a_worker_that_beats_just_after_a_check_found_none_is_not_refused(ingress, redis_client):
    """A replica that answered /health before the first beat caches "no worker" for a
    second; a request right after the worker's beat must still be admitted."""
    assert ingress.request("GET", "/health")[0] == 503  # caches a count of zero
    add_worker(redis_client, ingress.config)
    body = {"model": MODEL, "prompt": "a"}
    with Upstream(ingress.config.redis_url, ingress.config, lambda r: deltas(r.rid, [("a", [1])])):
        assert ingress.post("/v1/completions", body)[0] == 200


def test_a_heartbeat_gap_shorter_than_its_ttl_does_not_refuse_requests(ingress, redis_client):
    """A late beat (a paused host) is not a dead fleet: jobs go to the router, which
    holds them until a worker beats again."""
    add_worker(redis_client, ingress.config)
    body = {"model": MODEL, "prompt": "a"}
    with Upstream(ingress.config.redis_url, ingress.config, lambda r: deltas(r.rid, [("a", [1])])):
        assert ingress.post("/v1/completions", body)[0] == 200
        redis_client.delete(ingress.config.heartbeat_key("w0"))  # the beat is late
        time.sleep(1.1)  # past the ingress's cached count
        assert ingress.request("GET", "/health")[0] == 503  # /health says what is true now
        assert ingress.post("/v1/completions", body)[0] == 200
