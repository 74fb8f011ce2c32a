"""Both front doors read a request with jobs/request_normaliser.py: `Engine.generate` and the
pipeline (its tokenizer stage, then the worker's admission, which calls
`Engine.sampling_params` and `Engine.build_request`) give the same error for the same bad
input, and apply the same defaults."""

from __future__ import annotations

import pytest

from bus.actor import Inbound
from gpu_worker import Engine
from jobs.chat_messages import template_error, template_input
from jobs.field_error import FieldError
from jobs.model_tokenizer import load_model_tokenizer
from jobs.protocol import ErrorReply, GenerateRequest, TokenizedRequest
from jobs.request_normaliser import (
    ModelLimits,
    Prompt,
    check_fits,
    check_token_ids,
    encode_prompts,
    split_prompts,
)
from runtime.config import BusConfig
from stages.tokenizer.stage import TokenizerStage

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine("random:tiny-llama", dtype="float32")


@pytest.fixture(scope="module")
def stage(tiny) -> TokenizerStage:
    """The pipeline's door for the same model: no tokenizer, its context length known."""
    return TokenizerStage(BusConfig(), None, tiny.runner.context_length)


def engine_error(engine: Engine, sampling, **prompt) -> tuple:
    with pytest.raises(ValueError) as caught:
        engine.generate(sampling_params=sampling, **prompt)
    error = caught.value
    return getattr(error, "field", None), str(error), getattr(error, "code", None)


def stage_output(stage: TokenizerStage, sampling, **prompt):
    job = GenerateRequest("r1", "t:reply", sampling=dict(sampling or {}), **prompt)
    (output,) = stage.handle([Inbound(b"1-0", job)])
    return output.message


def stage_error(stage: TokenizerStage, sampling, **prompt) -> tuple:
    reply = stage_output(stage, sampling, **prompt)
    assert isinstance(reply, ErrorReply) and reply.status == 400, reply
    return reply.param, reply.message, reply.code


CONTEXT = 512  # tiny-llama's


@pytest.mark.parametrize(
    ("sampling", "prompt", "field"),
    [
        (None, {"input_ids": []}, "input_ids"),
        (None, {"input_ids": [3, -1]}, "input_ids"),
        (None, {"prompt": "hello"}, "prompt"),
        (None, {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        (None, {"input_ids": [1] * CONTEXT}, "input_ids"),
        ({"max_new_tokens": 10}, {"input_ids": [1] * (CONTEXT - 5)}, "max_new_tokens"),
    ],
    ids=[
        "empty",
        "negative-id",
        "text-without-tokenizer",
        "chat-without-tokenizer",
        "no-room",
        "past-the-context",
    ],  # fmt: skip
)
def test_both_doors_give_the_same_error(tiny, stage, sampling, prompt, field):
    assert tiny.runner.context_length == CONTEXT
    from_engine = engine_error(tiny, sampling, **prompt)
    assert from_engine == stage_error(stage, sampling, **prompt)
    assert from_engine[0] == field


def test_an_id_past_the_vocabulary_is_the_same_error_from_the_worker_as_from_the_engine(
    tiny, stage
):
    """The tokenizer stage does not know the vocabulary the worker loaded: it forwards the
    job, and the worker's admission refuses it as Engine.generate does."""
    ids = [1, tiny.vocab_size]
    forwarded = stage_output(stage, None, input_ids=ids)
    assert isinstance(forwarded, TokenizedRequest)
    with pytest.raises(FieldError) as worker:
        params = tiny.sampling_params(forwarded.sampling, len(ids))
        tiny.build_request("r1", forwarded.input_ids, params, detokenize=False)
    expected = engine_error(tiny, None, input_ids=ids)
    assert (worker.value.field, str(worker.value), worker.value.code) == expected
    assert "token id" in expected[1]


def test_a_missing_max_new_tokens_is_all_that_fit_through_both_doors(tiny, stage):
    room = min(tiny.runner.context_length, tiny.runner.max_total_tokens)
    # The pipeline forwards the job as the client sent it; the worker applies the default.
    forwarded = stage_output(stage, None, input_ids=[1] * 10)
    assert isinstance(forwarded, TokenizedRequest) and forwarded.sampling == {}
    assert tiny.sampling_params(forwarded.sampling, 10).max_new_tokens == room - 10
    # Engine.generate, the same: a prompt three short of the room gets three tokens.
    out = tiny.generate(input_ids=[1] * (room - 3), sampling_params={"ignore_eos": True})
    assert (len(out["output_ids"]), out["finish_reason"]) == (3, "length")
    given = tiny.sampling_params({"max_new_tokens": 7}, 10)
    assert given.max_new_tokens == 7


class _TransformersTokenizer:
    """transformers' tokenizer as the normaliser's `PromptTokenizer`: the reference that
    every door's tokenizer (jobs/model_tokenizer.py) reads chats as."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf_tokenizer = hf_tokenizer

    def encode_batch(self, texts):
        return [self.hf_tokenizer.encode(text) for text in texts]

    def apply_chat_template(self, messages, tools=None):
        chat, extra = template_input(self.hf_tokenizer.chat_template, messages, tools)
        try:
            text = self.hf_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as exc:
            raise template_error(exc) from exc
        return self.hf_tokenizer.encode(text, add_special_tokens=False)


def test_the_model_tokenizer_reads_chats_as_transformers_does(default_tokenizer):
    """transformers' tokenizer and the one the engine and the stages use, behind the same
    normaliser: the same ids for a chat with tools, the same error for a bad one."""
    doors = [
        _TransformersTokenizer(default_tokenizer),
        load_model_tokenizer("smollm2-135m-instruct"),
    ]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "c1"},
    ]  # fmt: skip
    prompts = [
        Prompt("prompt", "Hello there"),
        Prompt("messages", history, [WEATHER]),
        Prompt("messages", [{"role": "user"}]),
        Prompt("messages", [{"role": "user", "content": None}]),
        Prompt("messages", []),
    ]
    reference, ours = (encode_prompts(prompts, tokenizer) for tokenizer in doors)
    assert reference[:2] == ours[:2]
    for one, other in zip(reference[2:], ours[2:], strict=True):
        assert isinstance(one, FieldError) and isinstance(other, FieldError)
        assert (one.field, str(one)) == (other.field, str(other))


def test_the_engine_takes_lists_of_prompts_and_a_job_takes_one():
    prompts, single = split_prompts(input_ids=[[1, 2], [3]], many=True)
    assert [p.value for p in prompts] == [[1, 2], [3]] and not single
    prompts, single = split_prompts(messages=[{"role": "user", "content": "x"}], many=True)
    assert len(prompts) == 1 and single
    with pytest.raises(FieldError, match="prompt: must be a string$"):
        split_prompts(prompt=["a", "b"])
    with pytest.raises(FieldError, match="tools"):
        split_prompts(input_ids=[1], tools=[WEATHER])
    with pytest.raises(ValueError, match="exactly one"):
        split_prompts(prompt="a", input_ids=[1])
    with pytest.raises(FieldError, match="give at least one prompt"):
        split_prompts(prompt=[], many=True)


@pytest.mark.parametrize(
    ("ids", "vocab", "message"),
    [
        ([], 10, "the prompt is empty"),
        ([1, True], 10, "must be integers, got True"),
        ([1, 2.0], 10, "must be integers"),
        ([1, -1], 10, "must be >= 0"),
        ([1, 10], 10, r"token id 10 is not in the vocabulary \[0, 10\)"),
    ],
)
def test_token_ids_are_integers_within_the_vocabulary(ids, vocab, message):
    with pytest.raises(FieldError, match=message):
        check_token_ids(ids, "input_ids", vocab)


def test_the_kv_pool_bounds_a_request_where_the_door_knows_it():
    limits = ModelLimits(vocab_size=10, context_length=100, kv_slots=50)
    assert limits.room(20) == 30
    check_fits(20, 30, "input_ids", limits)
    with pytest.raises(FieldError, match="KV slots") as caught:
        check_fits(20, 31, "input_ids", limits)
    assert caught.value.field == "max_new_tokens"
    with pytest.raises(FieldError, match="KV slots") as caught:
        check_fits(50, None, "prompt", limits)
    assert caught.value.field == "prompt"
    check_fits(10**6, 10**6, "input_ids", ModelLimits())  # nothing known: a later door checks
