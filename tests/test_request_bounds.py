"""Every request field is bounded, and a value past its bound is a 400 naming the field:
over HTTP (the real ingress), as a direct job (the real tokenizer stage, router and worker),
and never a 500 or a dead process. docs/BOUNDS.md lists the bounds."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from bus.actor import Actor, Inbound
from bus.reconnect import ensure_group
from jobs.field_error import FieldError
from jobs.protocol import ErrorReply, GenerateRequest, TokenBatch, TokenizedRequest, decode
from jobs.request_bounds import request_bounds
from jobs.sampling_params import wire_sampling
from jobs.wire import ENTRY_FIELD, encode
from runtime.config import BusConfig
from runtime.context_length import model_context_length
from stages.router.stage import RouterStage
from stages.tokenizer.stage import TokenizerStage
from tests.ingress_harness import MODEL, RunningIngress, add_worker
from tests.worker_thread import published_entries

DEEP_SCHEMA = "[" * 100_000  # what took the deployment down: RecursionError in json.loads


@pytest.fixture
def bounds_env(monkeypatch):
    """Set bound variables for this process; the cached bounds are read again."""

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        request_bounds.cache_clear()

    yield set_env
    monkeypatch.undo()
    request_bounds.cache_clear()


@pytest.fixture
def ingress(redis_url, redis_client):
    with RunningIngress(redis_url) as running:
        yield running


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def assert_refused(reply: tuple[int, dict], param: str, status: int = 400) -> str:
    code, body = reply
    assert code == status, body
    assert body["error"]["param"] == param, body
    return body["error"]["message"]


# ---- sampling bounds over HTTP --------------------------------------------------------------


@pytest.mark.parametrize(
    "stop, words",
    [
        (["s"] * 17, "at most 16 stop strings"),
        (["x" * 257], "257 characters"),
        (["x" * 250] * 5, "1250 characters together"),
        ([""], "empty"),
    ],
    ids=["count", "length", "total", "empty"],
)
def test_stop_strings_past_their_bounds_are_a_400_naming_stop(ingress, stop, words):
    message = assert_refused(ingress.post("/v1/chat/completions", chat(stop=stop)), "stop")
    assert words in message


def test_logit_bias_with_too_many_entries_is_a_400_naming_it(ingress):
    bias = {str(token): 1 for token in range(301)}
    message = assert_refused(
        ingress.post("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": bias}),
        "logit_bias",
    )
    assert "at most 300 entries" in message


def test_logit_bias_values_outside_openais_range_are_a_400(ingress):
    reply = ingress.post("/v1/chat/completions", chat(logit_bias={"5": 100.5}))
    assert "[-100, 100]" in assert_refused(reply, "logit_bias")


def test_too_many_stop_token_ids_are_a_400_naming_them(ingress):
    body = {"text": "a", "sampling_params": {"stop_token_ids": list(range(257))}}
    assert "at most 256" in assert_refused(ingress.post("/generate", body), "stop_token_ids")


def test_a_bound_is_a_setting(ingress, bounds_env):
    bounds_env(STREAMSERVE_MAX_STOP_STRINGS="2")
    assert_refused(ingress.post("/v1/chat/completions", chat(stop=["a", "b", "c"])), "stop")


def test_huge_numbers_are_a_400_not_an_overflow(ingress):
    assert_refused(ingress.post("/v1/chat/completions", chat(seed=2**70)), "seed")
    assert_refused(ingress.post("/v1/chat/completions", chat(temperature=10**400)), "temperature")
    assert_refused(ingress.post("/v1/chat/completions", chat(top_logprobs=21, logprobs=True)),
                   "top_logprobs")  # fmt: skip


# ---- prompt bounds over HTTP ----------------------------------------------------------------


def test_too_many_choices_are_a_400_naming_n(ingress):
    assert "at most 128 choices" in assert_refused(
        ingress.post("/v1/chat/completions", chat(n=129)), "n"
    )


def test_n_times_the_prompt_size_is_bounded(ingress, bounds_env):
    bounds_env(STREAMSERVE_MAX_REQUEST_PROMPT_TOKENS="1000")
    body = {"model": MODEL, "prompt": "x" * 100, "n": 11}
    assert "1100" in assert_refused(ingress.post("/v1/completions", body), "prompt")
    assert_refused(ingress.post("/generate", {"input_ids": [1] * 1001}), "input_ids")
    messages = [{"role": "user", "content": "y" * 600}] * 2
    assert_refused(ingress.post("/v1/chat/completions", {"model": MODEL, "messages": messages}),
                   "messages")  # fmt: skip


# ---- grammar bounds over HTTP ---------------------------------------------------------------


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_the_100000_bracket_json_schema_is_a_400_on_generate(ingress):
    body = {"text": "a", "sampling_params": {"json_schema": DEEP_SCHEMA}}
    assert "nests brackets" in assert_refused(ingress.post("/generate", body), "json_schema")


def test_a_deep_response_format_is_a_400_naming_it(ingress):
    spec = {"name": "deep", "schema": deep_schema(70)}  # 71 braces deep
    body = chat(response_format={"type": "json_schema", "json_schema": spec})
    assert "nests brackets" in assert_refused(
        ingress.post("/v1/chat/completions", body), "response_format"
    )


def test_a_deep_tool_schema_is_a_400_naming_tools(ingress):
    tool = {"type": "function", "function": {"name": "f", "parameters": deep_schema(70)}}
    body = chat(tools=[tool], tool_choice="required")
    assert_refused(ingress.post("/v1/chat/completions", body), "tools")


def test_a_grammar_past_its_size_bound_is_a_400(ingress, bounds_env):
    bounds_env(STREAMSERVE_MAX_GRAMMAR_BYTES="100")
    body = {"text": "a", "sampling_params": {"regex": "a" * 101}}
    assert "101 bytes" in assert_refused(ingress.post("/generate", body), "regex")


def test_a_grammar_that_does_not_compile_is_a_400(ingress):
    body = {"text": "a", "sampling_params": {"ebnf": "start: undefined_rule"}}
    assert "does not compile" in assert_refused(ingress.post("/generate", body), "ebnf")


def test_a_grammar_compiling_past_the_deadline_is_a_400(ingress, bounds_env, busy_compile_pool):
    bounds_env(STREAMSERVE_GRAMMAR_COMPILE_TIMEOUT_S="0.2")
    regex = f"(a|b)*{uuid.uuid4().hex}"  # never compiled before: no cache hit
    body = {"text": "a", "sampling_params": {"regex": regex}}
    assert "took longer than" in assert_refused(ingress.post("/generate", body), "regex")


def test_the_ingress_compiles_grammars_off_its_event_loop(ingress, monkeypatch):
    import jobs.grammar

    threads = []
    compiled = jobs.grammar._compiled

    def recording(name, spec):
        threads.append(threading.current_thread().name)
        return compiled(name, spec)

    monkeypatch.setattr(jobs.grammar, "_compiled", recording)
    regex = f"[ab]+{uuid.uuid4().hex}"
    # The scripted upstream is absent: a compiled grammar gets as far as "no live worker".
    status, _ = ingress.post("/generate", {"text": "a", "sampling_params": {"regex": regex}})
    assert status == 503
    assert threads and all(name.startswith("grammar-compile") for name in threads), threads


def test_the_direct_client_refuses_the_deep_schema_before_sending():
    with pytest.raises(FieldError) as refused:
        wire_sampling({"json_schema": DEEP_SCHEMA})
    assert refused.value.field == "json_schema"


# ---- the worker: a direct job with a poison grammar ----------------------------------------


@pytest.fixture(scope="module")
def engine():
    from gpu_worker import Engine

    return Engine("random:tiny-llama", dtype="float32")


def test_the_deep_schema_onto_tokenized_is_a_400_and_the_worker_serves_the_next(
    redis_url, redis_client, engine
):
    from gpu_worker.worker import Worker

    config = BusConfig(redis_url=redis_url, block_ms=5)
    worker = Worker(engine, redis_client, config, "w0", "random:tiny-llama")
    ensure_group(redis_client, worker.bus.stream, "worker")
    add_worker(redis_client, config, "w0")
    router = Actor(redis_client, config, RouterStage(config, redis_client, threading.Event()))
    ensure_group(redis_client, config.tokenized_stream(), "router")
    reply_to = config.reply_stream("direct")
    poison = TokenizedRequest("poison", reply_to, [1, 2, 3], {"json_schema": DEEP_SCHEMA})
    fine = TokenizedRequest("fine", reply_to, [1, 2, 3], {"max_new_tokens": 3})
    for job in (poison, fine):
        redis_client.xadd(config.tokenized_stream(), {ENTRY_FIELD: encode(job)})
    while router.run_once():
        pass
    worker._admit(worker.bus.read_blocking())
    while worker.scheduler.has_work():
        worker._step()
    worker._commit(read=False)

    (_, fields), *_ = redis_client.xrange(reply_to)
    error = decode(fields[ENTRY_FIELD], ErrorReply)
    assert (error.rid, error.status, error.param) == ("poison", 400, "json_schema")
    batches = [decode(f[ENTRY_FIELD], TokenBatch) for _, f in
               published_entries(redis_client, config)]  # fmt: skip
    served = [item for batch in batches for item in batch.items if item.rid == "fine"]
    assert served[-1].finish is not None and served[-1].finish.reason == "length"


def test_the_workers_grammar_compile_has_a_deadline_and_catches_everything(bounds_env, request):
    from gpu_worker.sampling.grammar import Grammars
    from jobs.model_tokenizer import load_model_tokenizer
    from jobs.sampling_params import SamplingParams

    tokenizer = load_model_tokenizer("smollm2-135m-instruct")
    grammars = Grammars(tokenizer, tokenizer.vocab_size, [0])
    with pytest.raises(FieldError) as bad:
        grammars.matcher(SamplingParams(ebnf="start: undefined_rule"))
    assert bad.value.field == "ebnf"
    assert grammars.matcher(SamplingParams(regex="[ab]+")) is not None
    bounds_env(STREAMSERVE_GRAMMAR_COMPILE_TIMEOUT_S="0.2")
    request.getfixturevalue("busy_compile_pool")  # the compile below cannot finish in time
    with pytest.raises(FieldError, match="took longer than") as slow:
        grammars.matcher(SamplingParams(regex=f"(a|b)*{uuid.uuid4().hex}"))
    assert slow.value.field == "regex"


# ---- the tokenizer stage: prompts against the context ----------------------------------------


def tokenizer_turn(config: BusConfig, job: GenerateRequest, context_length: int):
    stage = TokenizerStage(config, None, context_length)
    return stage.handle([Inbound(b"1-0", job)])


def test_a_prompt_beyond_the_context_is_refused_before_any_worker_stream(redis_url):
    config = BusConfig(redis_url=redis_url)
    job = GenerateRequest("long", "t:reply", input_ids=[1] * 64)
    (output,) = tokenizer_turn(config, job, context_length=64)
    assert output.stream == "t:reply"  # the reply, not the tokenized stream
    reply = output.message
    assert (reply.status, reply.param, reply.code) == (400, "input_ids", "context_length_exceeded")
    assert "maximum context length is 64 tokens" in reply.message


def test_prompt_plus_max_new_tokens_beyond_the_context_is_refused(redis_url):
    config = BusConfig(redis_url=redis_url)
    job = GenerateRequest("long", "t:reply", input_ids=[1] * 40, sampling={"max_new_tokens": 30})
    (output,) = tokenizer_turn(config, job, context_length=64)
    assert output.message.param == "max_new_tokens"
    assert "you requested 70 tokens (40 in the input_ids, 30 in the completion)" in (
        output.message.message
    )
    fits = GenerateRequest("ok", "t:reply", input_ids=[1] * 40, sampling={"max_new_tokens": 24})
    (output,) = tokenizer_turn(config, fits, context_length=64)
    assert output.stream == config.tokenized_stream()


def test_the_context_length_is_read_from_the_gguf_header():
    assert model_context_length("smollm2-135m-instruct") == 8192
    assert model_context_length("random:tiny-llama") is None


def test_a_chat_beyond_the_context_names_messages_over_the_real_stage(redis_url, redis_client):
    from jobs.model_tokenizer import load_model_tokenizer

    config = BusConfig(redis_url=redis_url, block_ms=5)
    stage = TokenizerStage(config, load_model_tokenizer("smollm2-135m-instruct"), 32)
    ensure_group(redis_client, config.requests_stream(), "tokenizer")
    actor = Actor(redis_client, config, stage)
    job = GenerateRequest("chat", "t:reply", messages=[{"role": "user", "content": "hi " * 50}])
    redis_client.xadd(config.requests_stream(), {ENTRY_FIELD: encode(job)})
    while actor.run_once():
        pass
    ((_, fields),) = redis_client.xrange("t:reply")
    reply = decode(fields[ENTRY_FIELD], ErrorReply)
    assert (reply.status, reply.param) == (400, "messages")
    assert redis_client.xlen(config.tokenized_stream()) == 0


def test_a_response_format_nested_past_json_parsing_is_a_400_not_a_500(ingress):
    raw = b'{"model": "test-model", "messages": [], "response_format": ' + b"[" * 100_000
    status, _, body = ingress.request("POST", "/v1/chat/completions", raw=raw)
    assert status == 400, body


def test_a_chat_beyond_the_context_is_a_400_over_http(redis_url, redis_client, ingress):
    """The real tokenizer stage behind the real ingress: the refusal reaches the client."""
    from jobs.model_tokenizer import load_model_tokenizer

    config = BusConfig(redis_url=redis_url, block_ms=5)
    add_worker(redis_client, config)
    stage = TokenizerStage(config, load_model_tokenizer("smollm2-135m-instruct"), 32)
    ensure_group(redis_client, config.requests_stream(), "tokenizer")
    stop = threading.Event()
    actor = Actor(redis.Redis.from_url(redis_url), config, stage, stop)
    thread = threading.Thread(target=actor.run, daemon=True)
    thread.start()
    try:
        reply = ingress.post("/v1/chat/completions", chat(messages=[
            {"role": "user", "content": "hello " * 60}]))  # fmt: skip
    finally:
        stop.set()
        thread.join(timeout=5)
    assert "maximum context length is 32 tokens" in assert_refused(reply, "messages")
    assert reply[1]["error"]["code"] == "context_length_exceeded"
    assert redis_client.xlen(config.tokenized_stream()) == 0
