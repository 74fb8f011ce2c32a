"""The whole system, end to end: `streamserve up` (every stage its own process, the real
default model) driven over HTTP with the official `openai` client, over native /generate,
and with direct Redis jobs. The worker speculates with n-gram drafts, so every check here
(greedy equal to transformers, concurrent streams equal to one-by-one runs, stops,
logprobs, aborts) holds with speculative decoding too; the other pipeline tests run
without it."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import openai
import pytest

from bus.client import AsyncClient, Client
from gpu_worker.hf_reference import hf_greedy
from stages.router.stage import live_workers
from tests.pipeline_harness import SPECULATIVE_WORKER, Pipeline
from tests.prometheus_text import total

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def pipeline():
    # float32: greedy ties then break as in transformers' float32 reference, whatever the batch.
    with Pipeline(MODEL, worker_arg=SPECULATIVE_WORKER) as running:
        yield running


@pytest.fixture(scope="module")
def client(pipeline):
    return openai.OpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)


def chat(client, content: str, max_tokens: int = 16, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )


def test_chat_streamed_through_the_openai_client_equals_the_non_streamed_answer(client):
    whole = chat(client, "What is the capital of France?")
    stream = chat(
        client,
        "What is the capital of France?",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 10  # the chat template's tokens


def test_greedy_pipeline_tokens_equal_transformers_generate(pipeline, hf_default_model):
    prompts = [[1, 504, 3458, 314, 4649, 282], list(range(200, 260))]
    expected = hf_greedy(hf_default_model, prompts, max_new_tokens=12, stop_at_eos=False)
    for prompt, want in zip(prompts, expected, strict=True):
        status, body = pipeline.post(
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {**GREEDY, "max_new_tokens": 12, "ignore_eos": True},
            },  # fmt: skip
        )
        assert status == 200, body
        assert body["output_ids"] == want


def test_completions_take_text_and_token_id_prompts_alike(client, default_tokenizer):
    text = "The three primary colors are"
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0)
    ids = default_tokenizer.encode(text)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)


def test_native_generate_streams_the_same_tokens_it_returns_whole(pipeline):
    import json
    import urllib.request

    body = {"text": "Once upon a time", "sampling_params": {**GREEDY, "max_new_tokens": 10}}
    status, whole = pipeline.post("/generate", body)
    assert status == 200 and whole["meta_info"]["completion_tokens"] == len(whole["output_ids"])
    request = urllib.request.Request(
        pipeline.url + "/generate",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    ids, text = [], ""
    with urllib.request.urlopen(request, timeout=60) as reply:
        for line in reply:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                event = json.loads(line[6:])
                ids += event["output_ids"]
                text += event["text"]
    assert ids == whole["output_ids"] and text == whole["text"]


def test_direct_redis_jobs_sync_and_async_equal_http(pipeline):
    prompt = list(range(300, 340))
    sampling = {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}
    _, http = pipeline.post("/generate", {"input_ids": prompt, "sampling_params": sampling})
    with Client(pipeline.redis_url) as sync_client:
        result = sync_client.generate(input_ids=prompt, sampling=sampling)
    assert result["output_ids"] == http["output_ids"]
    assert result["finish_reason"] == "length"

    async def run_async():
        async_client = AsyncClient(pipeline.redis_url)
        try:
            return await async_client.generate(
                messages=[{"role": "user", "content": "Hi"}], sampling=sampling
            )
        finally:
            await async_client.close()

    assert len(asyncio.run(run_async())["output_ids"]) == 8


def test_32_concurrent_streams_equal_the_same_prompts_run_one_by_one(pipeline):
    questions = [f"Name {n} animals that live in the {place}." for n in range(1, 5)
                 for place in ("sea", "desert", "forest", "mountains", "arctic", "city",
                               "jungle", "river")]  # fmt: skip
    assert len(questions) == 32
    aclient = openai.AsyncOpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)

    async def one(question: str) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}],
            max_tokens=12, temperature=0, stream=True,
        )  # fmt: skip
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run():
        one_by_one = [await one(q) for q in questions]
        together = await asyncio.gather(*(one(q) for q in questions))
        return one_by_one, together

    one_by_one, together = asyncio.run(run())
    assert all(one_by_one)
    assert together == one_by_one


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 4}}, 400, None),
        ({"input_ids": [1, 10**6], "sampling_params": {"max_new_tokens": 4}}, 400, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}, 400, None),
        ({"text": "hi", "sampling_params": {"logit_bias": {"999999": 1}}}, 400, "logit_bias"),
    ],
)
def test_rejections_known_only_downstream_are_still_4xx(pipeline, body, status, param):
    code, reply = pipeline.post("/generate", body)
    assert code == status, reply
    assert reply["error"]["message"]
    if param is not None:
        assert reply["error"]["param"] == param


def test_a_client_that_disconnects_frees_its_request_within_a_step(pipeline, client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten thousand."}],
        max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = live_workers(pipeline_client(pipeline), pipeline.config)
        if workers and all(w.queued == 0 for w in workers):
            return
        time.sleep(0.2)
    pytest.fail(f"the request still runs after the client left: {workers}")


def test_post_abort_ends_a_running_stream_with_finish_reason_abort(pipeline, client):
    stream = client.completions.create(
        model=MODEL, prompt="Count to ten thousand:", max_tokens=4000, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            assert pipeline.post(f"/v1/abort/{chunk.id}", {})[0] == 200
    assert chunks[-1].choices[0].finish_reason == "abort"
    assert len(chunks) < 200  # the worker stopped within a few steps
    assert pipeline.post(f"/v1/abort/{chunk.id}", {})[0] == 404  # done now


def pipeline_client(pipeline):
    import redis

    return redis.Redis.from_url(pipeline.redis_url)


def test_n_choices_and_stop_strings(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a list of fruits."}],
        max_tokens=30, temperature=0.8, seed=1, n=3, stop=["\n"],
    )  # fmt: skip
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        assert "\n" not in choice.message.content


def test_health_and_models(pipeline, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    import json
    import urllib.request

    with urllib.request.urlopen(pipeline.url + "/health", timeout=5) as reply:
        assert reply.status == 200
        health = json.loads(reply.read())
    # Each worker says what serves its attention (the CPU kernels, on this machine).
    assert len(health["serving"]) == health["workers"]
    assert all(
        path.startswith(("cpu_kernel", "torch_native")) for path in health["serving"].values()
    )


def test_logprobs_name_each_token_and_its_alternatives(client):
    reply = chat(client, "Say hello.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert token.logprob <= 0
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: the chosen one is top
        assert not any(t.token.startswith("<") and t.token.endswith(">") for t in
                       token.top_logprobs if t.token[1:-1].isdigit())  # fmt: skip


def test_speculation_reports_accepted_predictions_in_usage_and_metrics(pipeline, client):
    passage = "the quick brown fox jumps over the lazy dog, " * 6
    reply = chat(client, f"Repeat exactly: {passage}", max_tokens=48)
    details = reply.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    with urllib.request.urlopen(pipeline.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    # The worker counts it when the request finishes, and publishes every interval.
    deadline = time.monotonic() + 10
    while not total(metrics, "streamserve:spec_decode_num_accepted_tokens_total"):
        assert time.monotonic() < deadline, "accepted drafts never reached /metrics"
        time.sleep(0.5)
        with urllib.request.urlopen(pipeline.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
