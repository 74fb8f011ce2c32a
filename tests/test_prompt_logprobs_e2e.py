"""Prompt logprobs through the whole system: /v1/completions' ``echo`` with ``logprobs`` (what
lm-evaluation-harness's local-completions model sends for loglikelihood) and /generate's
``return_prompt_logprobs``, equal to transformers' for the same tokens in float32."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."
TOLERANCE = 2e-3


def _reference(hf_model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[p, ids[p + 1]].item() for p in range(len(ids) - 1)]


def test_echo_with_logprobs_and_no_tokens_returns_the_prompts_logprobs(
    openai_client, hf_default_model, default_tokenizer
):
    ids = default_tokenizer.encode(PROMPT)
    answer = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    choice = answer.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(_reference(hf_default_model, ids),
                                                        abs=TOLERANCE)  # fmt: skip
    first, second = (len(token) for token in logprobs.tokens[:2])
    assert logprobs.text_offset[:3] == [0, first, first + second]


def test_token_prompts_as_lm_eval_sends_them(openai_client, hf_default_model, default_tokenizer):
    contexts = ["Question: what is two plus two? Answer:", "The sky is"]
    continuations = [" four", " blue"]
    prompts = [
        default_tokenizer.encode(c + x) for c, x in zip(contexts, continuations, strict=True)
    ]
    answer = openai_client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    for choice, ids in zip(sorted(answer.choices, key=lambda c: c.index), prompts, strict=True):
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(ids) + 1  # the prompt, then one token
        assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
            _reference(hf_default_model, ids), abs=TOLERANCE
        )
        # lm-eval's is_greedy: the token is its position's likeliest (top_logprobs: 1).
        for token_logprob, top in zip(
            logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
        ):
            assert len(top) == 1 and max(top.values()) >= token_logprob - 1e-6
        assert choice.text.startswith(default_tokenizer.decode(ids))


def test_a_streamed_echo_is_the_whole_answer(openai_client):
    request = dict(model=MODEL, prompt=PROMPT, echo=True, max_tokens=8, temperature=0)
    whole = openai_client.completions.create(**request).choices[0].text
    streamed = "".join(
        chunk.choices[0].text for chunk in openai_client.completions.create(**request, stream=True)
        if chunk.choices
    )  # fmt: skip
    assert streamed == whole and whole.startswith(PROMPT) and len(whole) > len(PROMPT)


def test_generate_returns_input_token_logprobs(float32_pipeline, hf_default_model,
                                               default_tokenizer):  # fmt: skip
    ids = default_tokenizer.encode(PROMPT)
    body = {"input_ids": ids, "return_prompt_logprobs": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}  # fmt: skip
    status, answer = float32_pipeline.post("/generate", body)
    assert status == 200, answer
    entries = answer["meta_info"]["input_token_logprobs"]
    assert [token for _, token, _ in entries] == ids
    assert entries[0][0] is None
    got = [logprob for logprob, _, _ in entries[1:]]
    assert got == pytest.approx(_reference(hf_default_model, ids), abs=TOLERANCE)
    assert len(answer["output_ids"]) == 2


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": "yes"}, "echo"),
        ("/generate", {"text": "Hi", "return_prompt_logprobs": 1}, "return_prompt_logprobs"),
    ],
    ids=["no-tokens-without-echo", "echo-not-boolean", "not-boolean"],
)
def test_bad_prompt_logprob_requests_are_4xx(float32_pipeline, path, body, param):
    status, answer = float32_pipeline.post(path, body)
    assert 400 <= status < 500, answer
    assert answer["error"]["param"] == param, answer
