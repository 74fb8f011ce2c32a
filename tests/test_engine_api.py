"""The engine's user-facing behaviour: chat, streaming, stop strings, seeds, logprobs, abort."""

from __future__ import annotations

import pytest

from gpu_worker import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def engine():
    # float32: greedy choices must not depend on what else is in the batch.
    return Engine("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="module")
def tiny():
    return Engine("random:tiny-llama", dtype="float32")


def test_chat_messages_answer_the_question(engine):
    out = engine.generate(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        sampling_params=GREEDY,
    )
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] == len(out["output_ids"])


def test_list_of_prompts_gives_results_in_order(engine):
    outs = engine.generate(["Hello", "The sky is"], GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    alone = engine.generate("The sky is", GREEDY)
    assert outs[1]["output_ids"] == alone["output_ids"]


def test_stream_chunks_add_up_to_the_full_result(engine):
    prompt = "Write one sentence about the moon."
    full = engine.generate(prompt, GREEDY)
    chunks = list(engine.generate_stream(prompt, GREEDY))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["finish_reason"] == full["finish_reason"]
    usage = dict(chunks[-1]["usage"], cached_tokens=0)  # the second run hits the prefix cache
    assert usage == dict(full["usage"], cached_tokens=0)


def test_stop_string_ends_the_text_before_it(engine):
    params = dict(GREEDY, max_new_tokens=40)
    prompt = "Count from one to ten in words, separated by commas."
    full = engine.generate(prompt, params)["text"]
    assert len(full) > 12, full
    stop = full[6:10]
    out = engine.generate(prompt, dict(params, stop=[stop]))
    assert out["finish_reason"] == "stop"
    assert out["matched_stop"] == stop
    assert out["text"] == full[: full.index(stop)]
    streamed = "".join(c["text"] for c in engine.generate_stream(prompt, dict(params, stop=stop)))
    assert streamed == out["text"]


def test_stop_token_id_ends_generation(engine):
    story = [{"role": "user", "content": "Tell me a story about a cat."}]
    full = engine.generate(messages=story, sampling_params=GREEDY)
    stop_token = full["output_ids"][3]
    out = engine.generate(messages=story, sampling_params=dict(GREEDY, stop_token_ids=[stop_token]))
    assert out["output_ids"] == full["output_ids"][: full["output_ids"].index(stop_token) + 1]
    assert out["finish_reason"] == "stop" and out["matched_stop"] == stop_token


def test_same_seed_same_output_whatever_the_batch(tiny):
    params = {"temperature": 1.0, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    alone = tiny.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    others = {"temperature": 1.0, "max_new_tokens": 9, "ignore_eos": True}
    batched = tiny.generate(
        input_ids=[[1, 2], [5, 6, 7], [9] * 30],
        sampling_params=[others, params, dict(others, seed=99)],
    )
    assert batched[1]["output_ids"] == alone
    other_seed = tiny.generate(input_ids=[5, 6, 7], sampling_params=dict(params, seed=4321))
    assert other_seed["output_ids"] != alone


def test_min_new_tokens_holds_back_eos(tiny):
    eos = next(iter(tiny.eos_ids))
    params = {
        "temperature": 0,
        "max_new_tokens": 8,
        "min_new_tokens": 8,
        "logit_bias": {eos: 100.0},
    }
    out = tiny.generate(input_ids=[1, 2, 3], sampling_params=params)
    assert len(out["output_ids"]) == 8 and eos not in out["output_ids"]
    params["min_new_tokens"] = 2
    out = tiny.generate(input_ids=[1, 2, 3], sampling_params=params)
    assert out["output_ids"][-1] == eos and len(out["output_ids"]) == 3


def test_logprobs_are_returned_per_token(tiny):
    params = {
        "temperature": 0,
        "max_new_tokens": 5,
        "logprobs": True,
        "top_logprobs": 3,
        "ignore_eos": True,
    }
    out = tiny.generate(input_ids=[1, 2, 3], sampling_params=params)
    assert len(out["logprobs"]) == 5 and all(lp <= 0 for lp in out["logprobs"])
    for token, logprob, top in zip(
        out["output_ids"], out["logprobs"], out["top_logprobs"], strict=True
    ):
        assert top[0][0] == token  # greedy picks the most likely token
        assert top[0][1] == pytest.approx(logprob)


def test_closing_a_stream_aborts_and_frees_its_kv(tiny):
    rows_free = tiny.runner.req_to_token_pool.available_size()
    stream = tiny.generate_stream(
        input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 100, "ignore_eos": True}
    )
    next(stream)
    next(stream)
    assert tiny.scheduler.has_work()
    stream.close()
    assert not tiny.scheduler.has_work()
    assert tiny.runner.req_to_token_pool.available_size() == rows_free


def test_flush_cache_frees_every_slot_and_is_refused_while_busy(tiny):
    allocator = tiny.runner.allocator
    total = allocator.available_size() + tiny.scheduler.kv.prefix_cache.total_size()
    tiny.generate(input_ids=[list(range(1, 40))], sampling_params={"max_new_tokens": 4})
    assert tiny.scheduler.kv.prefix_cache.total_size() > 0
    stream = tiny.generate_stream(
        input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 50, "ignore_eos": True}
    )
    next(stream)
    assert tiny.flush_cache() is False
    stream.close()
    assert tiny.flush_cache() is True
    assert tiny.scheduler.kv.prefix_cache.total_size() == 0
    assert allocator.available_size() == total
