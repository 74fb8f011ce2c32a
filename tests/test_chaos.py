"""Chaos: under a load of streaming requests, kill -9 one replica of each stage in turn; every
request still completes exactly once, with its full token count and (greedy) the same text
as without the kill.

One `streamserve up` with two replicas of every stage and two workers (float32, so greedy
outputs do not depend on batching). The launcher starts each killed replica again; the kill
lands while requests are in flight, so the survivors' claims (CPU stages) and the reaper
(workers) must pick up what the dead one held.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import pytest

from tests.pipeline_harness import (
    Pipeline,
    resume_stream,
    sse_events,
    stream_then_kill_its_ingress,
    worker_holding,
)
from tests.prometheus_text import total

pytestmark = pytest.mark.slow

REQUESTS = 12
MAX_TOKENS = 40
PROMPTS = [f"Story {i}: once upon a time, in a city of streams," for i in range(REQUESTS)]

# (what to kill, the fraction of the load's tokens streamed before the kill)
VICTIMS = [
    ("gpu_worker", 0.3),
    ("stage tokenizer", 0.0),
    ("stage router", 0.0),
    ("stage detokenizer", 0.3),
]


@pytest.fixture(scope="module")
def pipeline():
    replicas = {"ingress": 1, "tokenizers": 2, "routers": 2, "detokenizers": 2, "workers": 2}
    with Pipeline(worker_arg=["--dtype=float32"], **replicas) as running:
        yield running


async def _load(pipeline: Pipeline, kill: str | None, after: float) -> list[tuple[str, int, str]]:
    import openai

    client = openai.AsyncOpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)
    streamed = 0
    killed = asyncio.Event()

    def maybe_kill() -> None:
        if kill is not None and not killed.is_set() and streamed >= after * REQUESTS * MAX_TOKENS:
            killed.set()
            victim = pipeline.replica_pids(kill)[0]
            os.kill(victim, signal.SIGKILL)

    async def one(prompt: str) -> tuple[str, int, str]:
        nonlocal streamed
        stream = await client.completions.create(
            model=pipeline.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            timeout=180,
        )  # fmt: skip
        text, tokens, finish = "", 0, ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                streamed += 1
                maybe_kill()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens, finish

    tasks = [asyncio.create_task(one(prompt)) for prompt in PROMPTS]
    await asyncio.sleep(0.05)
    maybe_kill()  # a kill at 0.0 lands while the jobs pass through the CPU stages
    results = await asyncio.gather(*tasks)
    assert kill is None or killed.is_set()
    return results


@pytest.fixture(scope="module")
def undisturbed(pipeline):
    return asyncio.run(_load(pipeline, None, 0.0))


@pytest.mark.parametrize("victim, after", VICTIMS, ids=[v for v, _ in VICTIMS])
def test_every_request_completes_once_with_the_same_text_when_a_replica_is_killed(
    pipeline, undisturbed, victim, after
):
    assert all(tokens == MAX_TOKENS for _, tokens, _ in undisturbed)
    results = asyncio.run(_load(pipeline, victim, after))
    for (text, tokens, finish), (expected, _, _) in zip(results, undisturbed, strict=True):
        assert (tokens, finish) == (MAX_TOKENS, "length")
        assert text == expected


def test_a_stream_whose_ingress_is_killed_resumes_with_last_event_id(pipeline, undisturbed):
    body = {"model": pipeline.model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    text, last_id = stream_then_kill_its_ingress(pipeline, "/v1/completions", body)
    # Any replica (here the one the launcher starts again) resumes it.
    response = resume_stream(pipeline, "/v1/completions", body, last_id)
    events = list(sse_events(response))
    assert events[-1][1] == "[DONE]"
    text += "".join(json.loads(data)["choices"][0]["text"] for _, data in events[:-1])
    assert text == undisturbed[0][0]
    _wait_for_metrics(pipeline, "stream_resumes_total")


# Long enough to be cut mid-object: a list of bounded strings.
TRIP_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "stops": {"type": "array", "items": {"type": "string", "maxLength": 20},
                  "minItems": 4, "maxItems": 6},
    },
    "required": ["city", "stops"],
    "additionalProperties": False,
}  # fmt: skip


def _serving_worker_pid(pipeline: Pipeline, rid: str) -> int:
    """The pid of the worker holding `rid`: its consumer name on its own stream carries its
    pid (bus.actor.unique_consumer_name)."""
    import redis

    config = pipeline.config
    client = redis.Redis.from_url(pipeline.redis_url)
    try:
        worker_id = worker_holding(client, config, rid)
        consumers = client.xinfo_consumers(config.worker_stream(worker_id), "worker")
    finally:
        client.close()
    busy = next(c["name"] for c in consumers if c["pending"])
    return int((busy.decode() if isinstance(busy, bytes) else busy).rsplit("-", 2)[1])


def test_a_json_schema_stream_whose_worker_dies_mid_object_completes_as_undisturbed(pipeline):
    import openai

    client = openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)
    request = dict(
        model=pipeline.model, max_tokens=120, temperature=0, timeout=180,
        messages=[{"role": "user", "content": "Plan a day in Paris as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "trip", "schema": TRIP_SCHEMA}},
    )  # fmt: skip
    expected = client.chat.completions.create(**request).choices[0].message.content
    text, killed = "", False
    for chunk in client.chat.completions.create(**request, stream=True):
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        if not killed and len(text) > 12:  # inside the object, past its first key
            os.kill(_serving_worker_pid(pipeline, chunk.id + "-0"), signal.SIGKILL)
            killed = True
    assert killed
    assert text == expected
    trip = json.loads(text)
    assert set(trip) == {"city", "stops"} and 4 <= len(trip["stops"]) <= 6
    # The move shows in the deployment's metrics: out of the dead worker, into a live one.
    _wait_for_metrics(pipeline, "worker_jobs_migrated_out_total", "worker_jobs_migrated_in_total")


def test_a_streamed_response_whose_worker_dies_completes_as_undisturbed(pipeline):
    """The Responses API (/v1/responses) rides on the same jobs: its stream goes on, its
    events in order, its text that of the undisturbed answer."""
    import openai

    client = openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)
    # Three times the others' tokens: the kill must find the job still running when the
    # first text reaches this client, which a loaded host (CI) can run late.
    request = dict(model=pipeline.model, input=PROMPTS[1], max_output_tokens=3 * MAX_TOKENS,
                   temperature=0, timeout=180)  # fmt: skip
    expected = client.responses.create(**request, store=False).output_text
    text, killed, events = "", False, []
    for event in client.responses.create(**request, stream=True):
        events.append(event)
        if event.type != "response.output_text.delta":
            continue
        text += event.delta
        if not killed and text:
            os.kill(_serving_worker_pid(pipeline, events[0].response.id + "-0"), signal.SIGKILL)
            killed = True
    assert killed
    assert text == expected == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def _wait_for_metrics(pipeline: Pipeline, *counters: str) -> None:
    """Until each counter is above 0 at /metrics (processes publish every 2 s)."""
    deadline = time.monotonic() + 15
    while True:
        with urllib.request.urlopen(pipeline.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        if all((total(text, "streamserve:" + name) or 0) > 0 for name in counters):
            return
        assert time.monotonic() < deadline, f"{counters} not all counted:\n{text[-2000:]}"
        time.sleep(0.5)
