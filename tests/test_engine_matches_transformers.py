"""The correctness anchor: greedy tokens equal transformers' generate on the same weights,
whatever the batching, chunking, prefix-cache hits, page size or retraction."""

from __future__ import annotations

import pytest

from gpu_worker import Engine
from gpu_worker.hf_reference import hf_greedy

MAX_NEW = 24
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly, as if to a child who keeps asking why.",
    "hi",
    "Give me a short recipe for pancakes with flour, eggs, milk and a pinch of salt, "
    "then tell me how long to cook each side and how to keep them warm for a family of four.",
    "What is 17 times 23?",
    "Name a famous painting by Leonardo da Vinci.",
]


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    ids = [
        default_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    encoded = [default_tokenizer.encode(text, add_special_tokens=False) for text in ids]
    # Two prompts that share a long prefix with others, so the prefix cache gets hits.
    encoded.append(encoded[7][:-3] + encoded[0][-3:])
    encoded.append(encoded[5] + encoded[3][-4:])
    return encoded


@pytest.fixture(scope="module")
def reference_without_eos(hf_default_model, prompts) -> list[list[int]]:
    return hf_greedy(hf_default_model, prompts, MAX_NEW, stop_at_eos=False)


@pytest.fixture(scope="module")
def reference(hf_default_model, reference_without_eos) -> list[list[int]]:
    """transformers' greedy tokens stopping at end-of-sequence: those without stopping, up to
    and with the first (one prompt at a time, generate computes the same tokens until then;
    a second reference run cost ~12 s)."""
    eos = hf_default_model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    return [_through_first(tokens, eos) for tokens in reference_without_eos]


def _through_first(tokens: list[int], stops: set[int]) -> list[int]:
    ends = [i for i, token in enumerate(tokens) if token in stops]
    return tokens[: ends[0] + 1] if ends else tokens


def _engine_outputs(prompts, **options) -> tuple[list[list[int]], Engine]:
    engine = Engine("smollm2-135m-instruct", dtype="float32", **options)
    results = engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW}
    )
    return [r["output_ids"] for r in results], engine


CONFIGS = {
    "default": {},
    "prefix-cache-off": {"disable_radix_cache": True},
    "small-chunked-prefill": {"chunked_prefill_size": 16},
    "page-size-16": {"page_size": 16},
    "page-16-lpm-chunked": {"page_size": 16, "schedule_policy": "lpm", "chunked_prefill_size": 40},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_equal_transformers(name, prompts, reference):
    outputs, engine = _engine_outputs(prompts, **CONFIGS[name])
    assert outputs == reference
    engine.shutdown()


def test_prefix_cache_hits_keep_tokens_equal(prompts, reference):
    engine = Engine("smollm2-135m-instruct", dtype="float32")
    params = {"temperature": 0, "max_new_tokens": MAX_NEW}
    first = engine.generate(input_ids=prompts, sampling_params=params)
    second = engine.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in second] == reference
    assert all(r["usage"]["cached_tokens"] > 0 for r in second)
    assert [r["output_ids"] for r in first] == reference


@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_too_small_for_all_retracts_and_still_matches(
    prompts, reference_without_eos, page_size
):
    longest = max(len(p) for p in prompts) + MAX_NEW
    # Room for the longest request alone plus two pages, not for all of them at once; with
    # end-of-sequence ignored every request grows its full length, so decode must retract.
    pool = (-(-longest // page_size) + 2) * page_size
    # In arrival order, as this pool was sized for: shortest first (spf) can fit them
    # without a retraction at pages of 16.
    engine = Engine("smollm2-135m-instruct", dtype="float32", max_total_tokens=pool,
                    page_size=page_size, schedule_policy="fcfs")  # fmt: skip
    results = engine.generate(
        input_ids=prompts,
        sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    )
    assert engine.scheduler.num_retractions > 0
    assert [r["output_ids"] for r in results] == reference_without_eos
