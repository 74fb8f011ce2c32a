"""Every way a request can fail is an OpenAI-style error body with the right status, never a
500 for bad input and never a hang."""

from __future__ import annotations

import json
import time

import msgpack
import openai
import pytest

from jobs.protocol import ENTRY_FIELD, ErrorReply, Finish, GenerateRequest
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url, max_body_bytes=4096) as server:
        add_worker(redis_client, server.config)
        yield server


def assert_openai_error(status, body, expected_status, code=None, param=None):
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def chat_body(**extra):
    return {"model": MODEL, "messages": MESSAGES, **extra}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, chat_body(tools=[]), 400, "tools"),  # unknown field
        (CHAT, chat_body(temperature=-1), 400, "temperature"),
        (CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
        (CHAT, chat_body(max_completion_tokens=0), 400, "max_completion_tokens"),
        (CHAT, chat_body(top_p=0), 400, "top_p"),
        (CHAT, chat_body(n=0), 400, "n"),
        (CHAT, chat_body(n=1000), 400, "n"),
        (CHAT, chat_body(seed=-1), 400, "seed"),
        (CHAT, chat_body(stop=[""]), 400, "stop"),
        (CHAT, chat_body(logit_bias={"x": 1}), 400, "logit_bias"),
        (CHAT, chat_body(logit_bias={"1": 10**400}), 400, "logit_bias"),  # past any float
        (CHAT, chat_body(top_logprobs=3), 400, "top_logprobs"),  # needs logprobs: true
        (CHAT, chat_body(response_format={"type": "xml"}), 400, "response_format"),
        (CHAT, chat_body(response_format={"type": "json_schema"}), 400, "response_format"),
        (
            CHAT,
            chat_body(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            ),
            400,
            "response_format",
        ),  # fmt: skip
        (CHAT, chat_body(response_format="json"), 422, "response_format"),
        (CHAT, chat_body(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
        (CHAT, chat_body(max_tokens=10**30), 400, "max_tokens"),
        (CHAT, chat_body(stream_options={"include_usage": True}), 400, "stream_options"),
        (CHAT, chat_body(stream=True, stream_options={"usage": True}), 400, "usage"),
        (
            CHAT,
            chat_body(stream=True, stream_options={"include_obfuscation": True}),
            400,
            "stream_options.include_obfuscation",
        ),  # fmt: skip
        (CHAT, chat_body(messages=[]), 400, "messages"),
        (CHAT, chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
        (
            CHAT,
            chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            400,
            "messages",
        ),  # fmt: skip
        (CHAT, chat_body(messages=[{"role": "user"}]), 400, "messages"),
        (CHAT, chat_body(messages=[{"role": "system", "content": None}]), 400, "messages"),
        (CHAT, {"messages": MESSAGES}, 400, "model"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [2**40]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/generate", {"text": "a", "input_ids": [1]}, 400, "text"),
        ("/generate", {"text": "a", "sampling_params": {"nope": 1}}, 400, "nope"),
        ("/generate", {"text": "a", "sampling_params": {"temperature": -2}}, 400, "temperature"),
        ("/generate", {"text": "a", "sampling_params": {"regex": "a(b"}}, 400, "regex"),
        ("/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= ("}}, 400, "ebnf"),
        ("/generate", {"text": "a", "sampling_params": {"json_schema": "{"}}, 400, "json_schema"),
        (
            "/generate",
            {"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            400,
            "regex",
        ),  # fmt: skip
        # The body is JSON but a field has the wrong JSON type: 422.
        (CHAT, chat_body(temperature="hot"), 422, "temperature"),
        (CHAT, chat_body(max_tokens=True), 422, "max_tokens"),
        (CHAT, chat_body(max_tokens=1.5), 422, "max_tokens"),
        (CHAT, chat_body(stream="yes"), 422, "stream"),
        (CHAT, chat_body(messages="Hi"), 422, "messages"),
        (CHAT, chat_body(messages=["Hi"]), 422, "messages[0]"),
        (CHAT, chat_body(stop=3), 422, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 422, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 422, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": True}, 422, "logprobs"),
        (
            "/generate",
            {"text": "a", "sampling_params": {"max_new_tokens": "5"}},
            422,
            "max_new_tokens",
        ),  # fmt: skip
        ("/generate", {"text": "a", "sampling_params": []}, 422, "sampling_params"),
    ],
)
def test_bad_values_are_400_and_wrong_types_422_before_anything_is_queued(
    ingress, redis_client, path, body, status, param
):
    code, reply = ingress.post(path, body)
    assert_openai_error(code, reply, status, param=param)
    for stream in (ingress.config.requests_stream(), ingress.config.tokenized_stream()):
        assert redis_client.xlen(stream) == 0


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"{not json", 400),
        (b"\xff\xfe", 400),
        (b'{"a": NaN}', 400),
        (b"[1, 2]", 422),
        (b'"text"', 422),
        (b"", 400),
    ],  # fmt: skip
)
def test_malformed_bodies(ingress, raw, status):
    code, _, data = ingress.request("POST", CHAT, raw=raw)
    assert_openai_error(code, json.loads(data), status)


def test_unknown_model_is_404_model_not_found_through_the_openai_client(ingress):
    client = openai.OpenAI(base_url=ingress.url + "/v1", api_key="x", max_retries=0, timeout=5)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)


def test_unknown_path_404_and_wrong_method_405(ingress):
    status, _, data = ingress.request("GET", "/v1/nothing")
    assert_openai_error(status, json.loads(data), 404)
    status, headers, data = ingress.request("GET", CHAT)
    assert_openai_error(status, json.loads(data), 405)
    assert "POST" in headers["Allow"]


def test_body_over_the_limit_is_413(ingress):
    body = chat_body(messages=[{"role": "user", "content": "x" * 10_000}])
    status, reply = ingress.post(CHAT, body)
    assert_openai_error(status, reply, 413)


def test_full_queue_is_429_with_retry_after(redis_client, redis_url):
    with RunningIngress(redis_url, max_queue=2) as ingress:
        add_worker(redis_client, ingress.config)
        for _ in range(2):  # jobs no tokenizer has read yet
            redis_client.xadd(ingress.config.requests_stream(), {ENTRY_FIELD: b"x"})
        status, headers, data = ingress.request("POST", CHAT, chat_body())
    assert_openai_error(status, json.loads(data), 429, code="queue_full")
    assert int(headers["Retry-After"]) >= 1


def test_a_full_queue_counts_the_jobs_of_bundle_entries(redis_client, redis_url):
    """One entry carrying a commit's jobs (jobs/wire.py) counts as its jobs, not as one."""
    from jobs.wire import JOBS_FIELD

    with RunningIngress(redis_url, max_queue=3) as ingress:
        add_worker(redis_client, ingress.config)
        bundle = msgpack.packb([b"x", b"y", b"z"])
        redis_client.xadd(ingress.config.requests_stream(), {JOBS_FIELD: bundle})
        status, _, data = ingress.request("POST", CHAT, chat_body())
    assert_openai_error(status, json.loads(data), 429, code="queue_full")


def test_queue_depth_counts_what_a_group_has_not_acknowledged(redis_client, redis_url):
    """Read and acknowledged jobs stay in the stream; they must not count as queued."""
    with RunningIngress(redis_url, max_queue=2) as ingress:
        add_worker(redis_client, ingress.config)
        stream = ingress.config.requests_stream()
        for _ in range(5):
            redis_client.xadd(stream, {ENTRY_FIELD: b"x"})
        redis_client.xgroup_create(stream, "tokenizer", id="0")
        entries = redis_client.xreadgroup("tokenizer", "t1", {stream: ">"}, count=5)[0][1]
        redis_client.xack(stream, "tokenizer", *[entry_id for entry_id, _ in entries])
        with Upstream(redis_url, ingress.config, lambda r: deltas(r.rid, [("ok", [1])])):
            status, _ = ingress.post(CHAT, chat_body())
    assert status == 200


def test_no_live_worker_is_503(redis_client, redis_url):
    with RunningIngress(redis_url) as ingress:
        status, reply = ingress.post(CHAT, chat_body())
    assert_openai_error(status, reply, 503, code="no_worker")


def test_unreachable_redis_is_503(tmp_path):
    with RunningIngress(f"unix://{tmp_path}/no.sock") as ingress:
        status, reply = ingress.post(CHAT, chat_body())
        native_status, _ = ingress.post("/generate", {"text": "x"})
        code, _, data = ingress.request("GET", "/health")
    assert_openai_error(status, reply, 503, code="redis_unavailable")
    assert native_status == 503
    assert_openai_error(code, json.loads(data), 503, code="redis_unavailable")


def test_a_downstream_rejection_becomes_the_http_status(ingress):
    def reject(request: GenerateRequest):
        return [ErrorReply(request.rid, 400, "input_ids: token id 999999 is not in the vocabulary",
                           "invalid_request_error", "input_ids", "invalid_value")]  # fmt: skip

    with Upstream(ingress.config.redis_url, ingress.config, reject):
        status, reply = ingress.post("/generate", {"input_ids": [999999]})
        stream_status, _, data = ingress.request("POST", CHAT, chat_body(stream=True))
    assert_openai_error(status, reply, 400, param="input_ids", code="invalid_value")
    assert_openai_error(stream_status, json.loads(data), 400, param="input_ids")


def test_a_downstream_rejection_names_the_requests_own_field(ingress):
    """A worker refuses a job's json_schema or max_new_tokens: the answer names what the
    request sent (response_format, max_tokens, text, max_output_tokens)."""

    def reject(request: GenerateRequest):
        field = "json_schema" if request.sampling.get("json_schema") else "max_new_tokens"
        return [ErrorReply(request.rid, 400, f"{field} cannot be matched", "invalid_request_error",
                           field)]  # fmt: skip

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}}
    with Upstream(ingress.config.redis_url, ingress.config, reject):
        answers = [
            ingress.post(CHAT, chat_body(response_format=schema)),
            ingress.post(CHAT, chat_body(max_tokens=5)),
            ingress.post("/v1/responses", {"model": MODEL, "input": "x", "text": {"format": {
                "type": "json_schema", "name": "x", "schema": {"type": "string"}}}}),
            ingress.post("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 5}),
        ]  # fmt: skip
    for (status, reply), param in zip(
        answers, ["response_format", "max_tokens", "text", "max_output_tokens"], strict=True
    ):
        assert_openai_error(status, reply, 400, param=param)
        assert reply["error"]["message"] == f"{param} cannot be matched"


def test_a_finish_of_reason_error_is_the_requests_400_whole_or_streamed(ingress):
    """A worker ends a request as its own fault mid-answer (a grammar past the matcher's
    limits): a 400 naming the request's field, or an SSE error event after what was sent."""
    message = "json_schema cannot be followed further: lexer error"

    def fail_midway(request: GenerateRequest):
        out = deltas(request.rid, [("{", [1]), ('"a', [2])], reason="error", matched=message)
        finish = Finish.from_wire(out[-1].finish)
        finish.param = "json_schema"
        out[-1].finish = finish.to_wire()
        return out

    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with Upstream(ingress.config.redis_url, ingress.config, fail_midway):
        status, reply = ingress.post(CHAT, chat_body(response_format=schema))
        native, native_reply = ingress.post("/generate", {"text": "x", "sampling_params": {
            "json_schema": '{"type": "object"}'}})  # fmt: skip
        _, _, data = ingress.request("POST", CHAT, chat_body(response_format=schema, stream=True))
        text_format = {"format": {"type": "json_schema", "name": "x", "schema": {}}}
        responses = ingress.post("/v1/responses", {"model": MODEL, "input": "x",
                                                   "text": text_format})  # fmt: skip
    assert_openai_error(*responses, 400, param="text")
    assert_openai_error(status, reply, 400, param="response_format")
    assert reply["error"]["message"] == message.replace("json_schema", "response_format", 1)
    assert_openai_error(native, native_reply, 400, param="json_schema")
    events = [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "{"  # sent before it
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert [e["param"] for e in errors] == ["response_format"]


def test_an_error_after_the_stream_began_is_an_sse_error_event(ingress):
    def fail_midway(request: GenerateRequest):
        first = deltas(request.rid, [("Hel", [1]), ("lo", [2])])[0]
        return [first, ErrorReply(request.rid, 500, "the worker died", "internal_error")]

    client = openai.OpenAI(base_url=ingress.url + "/v1", api_key="x", max_retries=0, timeout=5)
    with Upstream(ingress.config.redis_url, ingress.config, fail_midway):
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError, match="the worker died"):
            list(stream)
        status, reply = ingress.post(CHAT, chat_body())
    assert_openai_error(status, reply, 500)


def test_one_failed_choice_fails_the_request_and_aborts_the_others(ingress, redis_client):
    def second_fails(request: GenerateRequest):
        if request.rid.endswith("-1"):
            return [ErrorReply(request.rid, 400, "prompt too long", "invalid_request_error")]
        return []  # the others never answer

    start = time.monotonic()
    with Upstream(ingress.config.redis_url, ingress.config, second_fails) as up:
        status, reply = ingress.post(CHAT, chat_body(n=3))
    assert_openai_error(status, reply, 400)
    assert time.monotonic() - start < 2
    others = [r.rid for r in up.requests if not r.rid.endswith("-1")]
    assert len(others) == 2
    deadline = time.monotonic() + 2
    while not all(redis_client.exists(ingress.config.abort_key(rid)) for rid in others):
        assert time.monotonic() < deadline, "the other choices were not aborted"
        time.sleep(0.02)


def test_malformed_reply_entries_are_ignored(ingress, redis_client):
    def garbage_then_answer(request: GenerateRequest):
        redis_client.xadd(request.reply_to, {ENTRY_FIELD: b"\xc1 not msgpack"})
        redis_client.xadd(request.reply_to, {"other": b"x"})
        return deltas(request.rid, [("ok", [1])])

    with Upstream(ingress.config.redis_url, ingress.config, garbage_then_answer):
        status, reply = ingress.post(CHAT, chat_body())
    assert status == 200 and reply["choices"][0]["message"]["content"] == "ok"
