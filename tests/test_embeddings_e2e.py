"""/v1/embeddings through the whole system with the official `openai` client: each input an
embedding job through tokenizer, router and worker, its vector transformers' final hidden
states for the same weights (the default model in float32), pooled and L2-normalized, in
either encoding, truncated by ``dimensions``; unchanged by a prefix the worker's cache holds
and by a generation running beside it; and every user error an OpenAI-style 4xx."""

from __future__ import annotations

import base64
import threading

import numpy as np
import openai
import pytest
import torch

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
HIDDEN = 576  # SmolLM2-135M's hidden size
TOLERANCE = 1e-4  # float32, another summation order and batch
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors."]


def _reference(hf_model, ids: list[int], pooling: str = "mean") -> np.ndarray:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()
    pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


def _close(got, expected: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == expected.shape
    assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


def test_a_string_and_a_list_equal_transformers_mean_pooled(
    openai_client, hf_default_model, default_tokenizer
):
    one = openai_client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    ids = default_tokenizer.encode(TEXTS[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    _close(one.data[0].embedding, _reference(hf_default_model, ids))
    # The client's default encoding is base64: little-endian float32, decoded by the client.
    many = openai_client.embeddings.create(model=MODEL, input=TEXTS)
    assert [item.index for item in many.data] == [0, 1]
    for item, text in zip(many.data, TEXTS, strict=True):
        _close(item.embedding, _reference(hf_default_model, default_tokenizer.encode(text)))
    assert many.usage.prompt_tokens == sum(len(default_tokenizer.encode(t)) for t in TEXTS)


def test_token_ids_last_pooling_and_base64_as_sent(openai_client, hf_default_model):
    prompts = [[504, 3458, 282, 4649, 314], [1345, 2, 90, 17]]
    answer = openai_client.embeddings.create(model=MODEL, input=prompts,
                                             extra_body={"pooling": "last"})  # fmt: skip
    for item, ids in zip(answer.data, prompts, strict=True):
        _close(item.embedding, _reference(hf_default_model, ids, "last"))
    raw = openai_client.embeddings.with_raw_response.create(
        model=MODEL, input=prompts[0], encoding_format="base64"
    ).http_response.json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    _close(np.frombuffer(packed, dtype="<f4"), _reference(hf_default_model, prompts[0]))
    assert raw["usage"] == {"prompt_tokens": 5, "total_tokens": 5}


def test_dimensions_truncate_then_renormalize(openai_client, hf_default_model, default_tokenizer):
    answer = openai_client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=64)
    full = _reference(hf_default_model, default_tokenizer.encode(TEXTS[1]))
    _close(answer.data[0].embedding, full[:64] / np.linalg.norm(full[:64]))


def test_a_prefix_in_the_cache_and_a_generation_beside_it_change_nothing(
    openai_client, hf_default_model, default_tokenizer
):
    shared = "A long shared system prompt that the prefix cache will hold for us. " * 6
    text = shared + "And then the question."
    # The shared prefix goes into the worker's prefix cache first.
    warm = openai_client.completions.create(model=MODEL, prompt=shared + "Hi", max_tokens=1)
    assert warm.usage.prompt_tokens > 64
    again = openai_client.completions.create(model=MODEL, prompt=shared + "Yo", max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the cache does hold it
    # A generation streams while the embedding's prefill runs.
    streamed = []
    generation = threading.Thread(target=lambda: streamed.extend(openai_client.completions.create(
        model=MODEL, prompt=shared, max_tokens=16, temperature=0, stream=True)))  # fmt: skip
    generation.start()
    answer = openai_client.embeddings.create(model=MODEL, input=[text, shared])
    generation.join()
    assert streamed and streamed[-1].choices[0].finish_reason is not None
    for item, prompt in zip(answer.data, [text, shared], strict=True):
        _close(item.embedding, _reference(hf_default_model, default_tokenizer.encode(prompt)))


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["fine", ""]}, 400, "input"),
        ({"input": 5}, 422, "input"),
        ({"input": [1, "a"]}, 422, "input"),
        ({"input": [[1, 2], []]}, 400, "input"),
        ({"input": [-1]}, 400, "input"),
        ({"input": [10**9]}, 400, "input"),  # past the vocabulary: the worker's check
        ({"input": [1] * 8193}, 400, "input"),  # past the context: the tokenizer stage's
        ({"input": ["x"] * 129}, 400, "input"),  # more inputs than STREAMSERVE_MAX_CHOICES
        ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
        ({"input": "hi", "dimensions": HIDDEN + 1}, 400, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "hi", "pooling": "max"}, 400, "pooling"),
        ({"input": "hi", "pooling": ""}, 400, "pooling"),
        ({"input": "hi", "extra": 1}, 400, "extra"),
        ({"input": "hi", "model": "other"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_style_4xx(openai_client, body, status, param):
    body = {"model": MODEL, **body}
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client.post("/embeddings", body=body, cast_to=object)
    error = caught.value
    assert error.status_code == status, error.body
    assert error.body["param"] == param, error.body
    assert error.body["type"] and error.body["message"]


def test_user_is_accepted(openai_client, hf_default_model):
    answer = openai_client.embeddings.create(model=MODEL, input=[[42] * 8], user="someone")
    _close(answer.data[0].embedding, _reference(hf_default_model, [42] * 8))
