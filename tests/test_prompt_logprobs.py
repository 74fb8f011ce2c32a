"""Prompt logprobs (the `prompt_logprobs` sampling parameter) equal transformers' for the same
tokens, in float32: whole or in prefill chunks, alone or batched, with a prefix the cache
holds (the positions whose logits are wanted are computed again), with max_new_tokens 0, and
past MAX_PROMPT_LOGIT_ROWS (the prefill is cut into chunks of that many)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.model_executor.forward_batch import MAX_PROMPT_LOGIT_ROWS

TOLERANCE = 2e-3  # float32, another summation order


@pytest.fixture(scope="module", params=[2048, 48], ids=["whole", "chunked"])
def engine(request):
    return Engine("smollm2-135m-instruct", dtype="float32", chunked_prefill_size=request.param)


def _reference(hf_model, ids: list[int], top: int = 0) -> tuple[list, list]:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = [None] + [logprobs[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    tops = [None] + [logprobs[p].topk(top).indices.tolist() for p in range(len(ids) - 1)]
    return chosen, tops


def _close(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    assert got[0] is None and expected[0] is None
    assert got[1:] == pytest.approx(expected[1:], abs=TOLERANCE)


def _prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_prompt_logprobs_equal_transformers(engine, hf_default_model):
    ids = _prompt(engine, "The quick brown fox jumps over the lazy dog, and then it " * 3)
    params = {"prompt_logprobs": True, "top_logprobs": 2, "max_new_tokens": 3, "temperature": 0}
    out = engine.generate(input_ids=ids, sampling_params=params)
    expected, tops = _reference(hf_default_model, ids, top=2)
    _close(out["prompt_logprobs"], expected)
    assert out["prompt_top_logprobs"][0] is None
    for got, want in zip(out["prompt_top_logprobs"][1:], tops[1:], strict=True):
        assert [token for token, _ in got] == want
    assert len(out["output_ids"]) == 3


def test_a_cached_prefix_is_computed_again_for_its_logits(engine, hf_default_model):
    shared = "A long shared system prompt that the prefix cache will hold. " * 4
    first = _prompt(engine, shared + "First question?")
    second = _prompt(engine, shared + "Second question, another one?")
    # Without prompt logprobs the shared prefix is cached, and the second request hits it.
    engine.generate(input_ids=first, sampling_params={"max_new_tokens": 1})
    hit = engine.generate(input_ids=second, sampling_params={"max_new_tokens": 1})
    assert hit["usage"]["cached_tokens"] > 0
    out = engine.generate(input_ids=second, sampling_params={"prompt_logprobs": True,
                                                             "max_new_tokens": 1})  # fmt: skip
    _close(out["prompt_logprobs"], _reference(hf_default_model, second)[0])
    assert out["usage"]["cached_tokens"] == 0


def test_max_new_tokens_0_returns_only_the_prompts_logprobs(engine, hf_default_model):
    prompts = [_prompt(engine, "One prompt."), _prompt(engine, "Another, somewhat longer prompt.")]
    params = {"prompt_logprobs": True, "max_new_tokens": 0}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == [] and out["finish_reason"] == "length"
        _close(out["prompt_logprobs"], _reference(hf_default_model, ids)[0])


def test_batched_with_other_requests_they_are_unchanged(engine, hf_default_model):
    prompts = [_prompt(engine, f"Prompt number {i}: " + "words " * (5 + 7 * i)) for i in range(4)]
    params = [{"prompt_logprobs": i % 2 == 0, "max_new_tokens": 4, "temperature": 0}
              for i in range(4)]  # fmt: skip
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    for i, (ids, out) in enumerate(zip(prompts, outs, strict=True)):
        if i % 2:
            assert "prompt_logprobs" not in out
        else:
            _close(out["prompt_logprobs"], _reference(hf_default_model, ids)[0])


def test_a_prompt_longer_than_one_forwards_logit_rows(engine, hf_default_model):
    ids = _prompt(engine, "Counting sheep: " + " ".join(str(i) for i in range(400)))
    assert len(ids) > MAX_PROMPT_LOGIT_ROWS + 10
    out = engine.generate(input_ids=ids, sampling_params={"prompt_logprobs": True,
                                                          "max_new_tokens": 2})  # fmt: skip
    _close(out["prompt_logprobs"], _reference(hf_default_model, ids)[0])


def test_max_new_tokens_0_without_prompt_logprobs_is_refused(engine):
    with pytest.raises(ValueError, match="0 only with prompt logprobs"):
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 0})
