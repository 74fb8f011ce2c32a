"""The deployment's metrics through its one scrape target: `streamserve up` with two replicas
of every stage and two workers, real requests, and /metrics read back with
prometheus-client's parser. Every family is there, from every process, and each moves as
the requests say it should."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import pytest

from jobs.protocol import ENTRY_FIELD
from tests.pipeline_harness import QUICK_RECOVERY_ENV, Pipeline
from tests.prometheus_text import samples, total

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
P = "streamserve:"
REPLICAS = {"ingress": 2, "tokenizers": 2, "routers": 2, "detokenizers": 2, "workers": 2}
ROLES = {"ingress": 2, "tokenizer": 2, "router": 2, "detokenizer": 2, "worker": 2}

# Family -> the roles whose processes export it (None: the deployment's streams).
FAMILIES = {
    "requests": ["ingress"], "requests_in_flight": ["ingress"],
    "time_to_first_token_seconds": ["ingress"], "inter_token_latency_seconds": ["ingress"],
    "e2e_request_latency_seconds": ["ingress"], "stream_resumes": ["ingress"],
    "request_aborts": ["ingress"], "live_workers": None,
    "num_requests_running": ["worker"], "num_requests_waiting": ["worker"],
    "kv_cache_usage_perc": ["worker"], "prefix_cache_queries": ["worker"],
    "prefix_cache_hits": ["worker"], "prompt_tokens": ["worker"],
    "generation_tokens": ["worker"], "request_success": ["worker"],
    "request_queue_time_seconds": ["worker"], "num_preemptions": ["worker"],
    "spec_decode_num_draft_tokens": ["worker"], "spec_decode_num_accepted_tokens": ["worker"],
    "worker_step_seconds": ["worker"], "worker_jobs_migrated_in": ["worker"],
    "worker_step_failures": ["worker"], "worker_info": ["worker"],
    "worker_jobs_migrated_out": ["router"],
    "router_decisions": ["router"], "router_expected_cached_tokens": ["router"],
    "router_routed_prompt_tokens": ["router"],
    "stage_entries": ["tokenizer", "router", "detokenizer"],
    "stage_batch_size": ["tokenizer", "router", "detokenizer"],
    "stage_handle_seconds": ["tokenizer", "router", "detokenizer"],
    "stage_dead_letters": ["tokenizer", "router", "detokenizer"],
    "stage_claimed_entries": ["tokenizer", "router", "detokenizer"],
    "stream_length": None, "stream_group_lag": None, "stream_group_pending": None,
    "stream_group_consumers": None,
}  # fmt: skip
# None above: the deployment's own gauges (streams, live workers), without role or replica.


@pytest.fixture(scope="module")
def pipeline():
    env = {**QUICK_RECOVERY_ENV, "STREAMSERVE_METRICS_INTERVAL_S": "0.5"}
    with Pipeline(MODEL, env=env, **REPLICAS) as running:
        yield running


def scrape(pipeline: Pipeline) -> str:
    with urllib.request.urlopen(pipeline.url + "/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def settled(pipeline: Pipeline, done, timeout_s: float = 20.0) -> str:
    """The scrape once `done(text)` holds (processes publish every interval)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(pipeline)
        if done(text):
            return text
        assert time.monotonic() < deadline, "the metrics did not settle:\n" + text[-3000:]
        time.sleep(0.5)


def stream_gauges(text: str, name: str) -> dict[tuple[str, str], float]:
    return {(labels["stream"], labels.get("group", "")): value
            for sample, labels, value in samples(text) if sample == P + name}  # fmt: skip


def test_one_target_shows_every_process_and_counts_what_was_sent(pipeline):
    completions = [pipeline.post("/v1/completions", {"model": MODEL, "prompt": f"Count to {i}:",
                                                     "max_tokens": 6, "temperature": 0})
                   for i in range(4)]  # fmt: skip
    chats = [pipeline.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 5,
                           "messages": [{"role": "user", "content": "Hi"}]})]  # fmt: skip
    assert all(status == 200 for status, _ in completions + chats)
    assert pipeline.post("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0})[0] == 400
    sent = len(completions) + len(chats)
    prompt = sum(body["usage"]["prompt_tokens"] for _, body in completions + chats)
    generated = sum(body["usage"]["completion_tokens"] for _, body in completions + chats)

    text = settled(pipeline, lambda t: total(t, P + "request_success_total") == sent
                   and total(t, P + "e2e_request_latency_seconds_count") == sent)  # fmt: skip
    by_name = {}
    for name, labels, _ in samples(text):
        by_name.setdefault(name, []).append(labels)
    # Every family, from every replica of the roles that export it.
    from observability.deployment_metrics import parse_families

    families = parse_families(text)
    for family, roles in FAMILIES.items():
        assert P + family in families, f"{family} missing"
        for role in roles or []:
            replicas = {s.labels["replica"] for s in families[P + family].samples
                        if s.labels.get("role") == role}  # fmt: skip
            if family not in ("worker_jobs_migrated_out",):  # labelled: none until a move
                assert len(replicas) == ROLES[role], (family, role, replicas)

    # Each series carries the labels the dashboard's queries group and match by.
    from tests.test_observability_deploy import FAMILY_LABELS, HISTOGRAMS

    for name, labels, _ in samples(text):
        family = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[0] in HISTOGRAMS else name
        assert set(labels) - {"le"} == FAMILY_LABELS[family], (name, labels)

    # Counts equal what was sent, summed over the replicas that served it.
    ok = {"endpoint": "/v1/completions", "status": "200"}
    assert total(text, P + "requests_total", **ok) == len(completions)
    assert total(text, P + "requests_total", endpoint="/v1/completions", status="400") == 1
    assert total(text, P + "requests_total", endpoint="/v1/chat/completions") == len(chats)
    assert total(text, P + "time_to_first_token_seconds_count") == sent
    assert total(text, P + "request_queue_time_seconds_count") == sent
    assert total(text, P + "prompt_tokens_total") == prompt
    assert total(text, P + "router_routed_prompt_tokens_total") == prompt  # nothing migrated
    assert total(text, P + "router_decisions_total") == sent
    assert total(text, P + "generation_tokens_total") == generated
    assert total(text, P + "prefix_cache_queries_total") == prompt
    assert total(text, P + "inter_token_latency_seconds_count") == generated - sent
    assert total(text, P + "stage_entries_total", role="tokenizer") == sent
    assert total(text, P + "stage_entries_total", role="router") == sent
    assert total(text, P + "stage_entries_total", role="detokenizer") >= sent
    assert total(text, P + "worker_step_seconds_count", kind="prefill") >= 1
    assert total(text, P + "worker_step_seconds_count", kind="decode") >= 1
    assert total(text, P + "live_workers") == ROLES["worker"]
    assert total(text, P + "stage_dead_letters_total") == 0

    # Every group has read and acknowledged everything: lag and pending back to 0.
    config = pipeline.config
    lag = stream_gauges(text, "stream_group_lag")
    pending = stream_gauges(text, "stream_group_pending")
    for stream, group in [(config.requests_stream(), "tokenizer"),
                          (config.tokenized_stream(), "router"),
                          (config.tokens_stream(), "detokenizer")]:  # fmt: skip
        assert lag[(stream, group)] == 0 and pending[(stream, group)] == 0, (stream, lag, pending)
    worker_streams = [key for key in lag if key[0].startswith(f"{config.stream_prefix}:worker:")]
    assert len(worker_streams) == ROLES["worker"]
    assert all(lag[key] == 0 and pending[key] == 0 for key in worker_streams)
    # The token batches are in the workers' logs: the detokenizers read them all too.
    logs = [key for key in lag if key[0].startswith(f"{config.stream_prefix}:progress:")]
    assert len(logs) == ROLES["worker"] and all(group == "detokenizer" for _, group in logs)
    assert all(lag[key] == 0 and pending[key] == 0 for key in logs), (lag, pending)


def test_dead_letters_and_aborts_are_counted(pipeline):
    import redis

    client = redis.Redis.from_url(pipeline.redis_url)
    config = pipeline.config
    client.xadd(config.requests_stream(), {ENTRY_FIELD: b"not msgpack"})
    # A streamed request whose client leaves after its first event: the ingress aborts it.
    connection = http.client.HTTPConnection("127.0.0.1", pipeline.port, timeout=30)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 200, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()

    text = settled(
        pipeline,
        lambda t: (
            total(t, P + "stage_dead_letters_total") == 1
            and (total(t, P + "request_aborts_total") or 0) >= 1
            and (total(t, P + "request_success_total", finished_reason="abort") or 0) >= 1
        ),
    )
    assert total(text, P + "stage_dead_letters_total", role="tokenizer") == 1
    assert total(text, P + "stream_length", stream=config.dead_letter_stream()) == 1


def _post(pipeline: Pipeline, path: str, body: dict) -> tuple[dict, bytes]:
    request = urllib.request.Request(pipeline.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        return dict(response.headers), response.read()


def test_each_answer_carries_its_queue_time_ttft_and_decode_time(pipeline):
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 6, "temperature": 0}
    headers, _ = _post(pipeline, "/v1/completions", body)
    queue, ttft, decode = (float(headers[f"X-Streamserve-{name}"])
                           for name in ("Queue-Time", "TTFT", "Decode-Time"))  # fmt: skip
    assert 0 <= queue <= ttft and decode > 0, headers
    # A stream's headers leave with its first tokens: the time to them, and nothing later.
    headers, data = _post(pipeline, "/v1/completions", {**body, "stream": True})
    assert float(headers["X-Streamserve-TTFT"]) > 0 and "X-Streamserve-Decode-Time" not in headers
    assert data.rstrip().endswith(b"data: [DONE]")
    _, data = _post(pipeline, "/generate", {"text": "Count: one, two,",
                                            "sampling_params": {"max_new_tokens": 6}})  # fmt: skip
    meta = json.loads(data)["meta_info"]
    assert 0 <= meta["queue_time"] <= meta["ttft"] and meta["decode_time"] > 0, meta
    _, data = _post(pipeline, "/generate", {"text": "Count: one, two,", "stream": True,
                                            "sampling_params": {"max_new_tokens": 6}})  # fmt: skip
    events = [json.loads(line[6:]) for line in data.decode().splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert "ttft" not in events[0]["meta_info"] and events[-1]["meta_info"]["ttft"] > 0
