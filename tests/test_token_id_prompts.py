"""A prompt of token ids skips the tokenizer stage: the ingress checks it as that stage would
and writes it straight to the router's stream (stages/ingress/request_writes.py).

In a whole running system (`streamserve up` with a synthetic worker: the real stages and the
real model's vocabulary and context, no model run): id prompts are answered without the
tokenizer group reading anything, text still goes through it, and every refusal is the one
the tokenizer stage gives, from an ingress that knows the context length and, through the
worker, from one that does not."""

from __future__ import annotations

import pytest
import redis

from bus.actor import Inbound
from gpu_worker.synthetic_engine import SyntheticEngine, synthetic_token
from jobs.protocol import ErrorReply, GenerateRequest
from runtime.config import BusConfig
from runtime.context_length import model_context_length
from stages.ingress.errors import error_body
from stages.tokenizer.stage import TokenizerStage
from tests.ingress_harness import MODEL as UNKNOWN_MODEL
from tests.ingress_harness import RunningIngress
from tests.pipeline_harness import Pipeline

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SYNTHETIC = ["--synthetic", "--synthetic-step-ms=5", "--synthetic-batch=4"]


@pytest.fixture(scope="module")
def pipeline():
    with Pipeline(MODEL, worker_arg=SYNTHETIC) as running:
        running.client = redis.Redis.from_url(running.redis_url)
        yield running
        running.client.close()


def _tokenizer_read(pipeline) -> int:
    """The entries the tokenizer group has read from the requests stream."""
    (group,) = pipeline.client.xinfo_groups(pipeline.config.requests_stream())
    return group["entries-read"] or 0


def _router_read(pipeline) -> int:
    (group,) = pipeline.client.xinfo_groups(pipeline.config.tokenized_stream())
    return group["entries-read"] or 0


def _expected(rid: str, tokens: int) -> list[int]:
    facts = SyntheticEngine(MODEL).facts
    return [synthetic_token(rid, i, facts) for i in range(tokens)]


def _tokenizer_refusal(job: GenerateRequest) -> dict:
    """The body the ingress answers with when the tokenizer stage refuses `job`."""
    stage = TokenizerStage(BusConfig(), None, model_context_length(MODEL))
    (output,) = stage.handle([Inbound(b"1-0", job)])
    assert isinstance(output.message, ErrorReply)
    return error_body(output.message)


def test_id_prompts_are_answered_without_the_tokenizer_reading_them(pipeline):
    requests, tokenizer, router = (pipeline.client.xlen(pipeline.config.requests_stream()),
                                   _tokenizer_read(pipeline), _router_read(pipeline))  # fmt: skip
    status, body = pipeline.post(
        "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6}}
    )
    assert status == 200, body
    assert body["output_ids"] == _expected(body["meta_info"]["id"], 6)
    completion = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4}
    status, body = pipeline.post("/v1/completions", completion)
    assert status == 200, body
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["prompt_tokens"] == 5
    assert pipeline.client.xlen(pipeline.config.requests_stream()) == requests
    assert _tokenizer_read(pipeline) == tokenizer
    assert _router_read(pipeline) == router + 2  # one entry a request, both its prompts in one


def test_text_prompts_still_go_through_the_tokenizer(pipeline):
    tokenizer = _tokenizer_read(pipeline)
    status, body = pipeline.post("/v1/completions",
                                 {"model": MODEL, "prompt": "Hello", "max_tokens": 3})  # fmt: skip
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 3
    assert _tokenizer_read(pipeline) == tokenizer + 1


@pytest.mark.parametrize(
    ("ids", "status", "code"),
    [([5, -1], 400, "invalid_value"), ([], 400, "invalid_value"),
     ([5, 1.5], 422, "invalid_type"), ([5, "6"], 422, "invalid_type")],
)  # fmt: skip
def test_ids_that_are_not_token_ids_are_refused_by_the_ingress_as_before(
    pipeline, ids, status, code
):
    tokenizer, router = _tokenizer_read(pipeline), _router_read(pipeline)
    answer, body = pipeline.post("/generate", {"input_ids": ids})
    assert (answer, body["error"]["param"], body["error"]["code"]) == (status, "input_ids", code)
    completion = {"model": MODEL, "prompt": ids, "max_tokens": 2}
    answer, body = pipeline.post("/v1/completions", completion)
    assert (answer, body["error"]["param"], body["error"]["code"]) == (status, "prompt", code)
    assert (_tokenizer_read(pipeline), _router_read(pipeline)) == (tokenizer, router)


# Past the context (8192): with its max_new_tokens, and alone (no room for one token).
PAST_CONTEXT = [([1] * 8000, {"max_new_tokens": 500}), ([1] * 8192, {})]


@pytest.mark.parametrize(("ids", "sampling"), PAST_CONTEXT)
def test_a_prompt_past_the_context_gets_the_tokenizer_stages_refusal(pipeline, ids, sampling):
    tokenizer = _tokenizer_read(pipeline)
    status, body = pipeline.post("/generate", {"input_ids": ids, "sampling_params": sampling})
    assert status == 400, body
    assert body == _tokenizer_refusal(GenerateRequest("r", "t:reply", input_ids=ids,
                                                      sampling=sampling))  # fmt: skip
    assert body["error"]["code"] == "context_length_exceeded"
    assert _tokenizer_read(pipeline) == tokenizer
    completion = {"model": MODEL, "prompt": ids, "stream": True,
                  **({"max_tokens": 500} if sampling else {})}  # fmt: skip
    # The same refusal, naming the field as the completion request does.
    own_name = {"max_new_tokens": "max_tokens", "input_ids": "prompt"}[body["error"]["param"]]
    assert pipeline.post("/v1/completions", completion) == (
        400,
        {"error": {**body["error"], "param": own_name}},
    )


@pytest.mark.parametrize(("ids", "sampling"), PAST_CONTEXT)
def test_an_ingress_without_the_models_files_leaves_the_refusal_to_the_worker(
    pipeline, ids, sampling
):
    """An ingress started with only the served name cannot read the context length: the
    job goes to the router, and the worker refuses it with the very same reply."""
    with RunningIngress(pipeline.redis_url) as ingress:
        assert ingress.state.limits.context_length is None
        status, body = ingress.post("/generate", {"input_ids": ids, "sampling_params": sampling})
        assert status == 400, body
        assert body == _tokenizer_refusal(GenerateRequest("r", "t:reply", input_ids=ids,
                                                          sampling=sampling))  # fmt: skip
        status, body = ingress.post(
            "/v1/completions", {"model": UNKNOWN_MODEL, "prompt": [5, 6], "max_tokens": 3}
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
