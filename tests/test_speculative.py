"""Speculative decoding with n-gram drafts: greedy output equals plain decoding in mixed
batches (chunked prefill, retraction, prefix cache, pages, stop conditions), and sampled
output keeps the target distribution."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from gpu_worker import Engine
from gpu_worker.speculative.ngram import NgramIndex

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_the_index_proposes_what_followed_the_last_earlier_match():
    assert NgramIndex().propose([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]
    assert NgramIndex().propose([5, 6, 7, 8], 3) == []  # no n-gram seen twice
    # A match running into the tokens being continued repeats with its period.
    assert NgramIndex().propose([4, 7, 7, 7], 5) == [7, 7, 7, 7, 7]
    assert NgramIndex().propose([1, 2, 1, 2], 3) == [1, 2, 1]


def test_the_index_grows_with_the_sequence():
    index, ids = NgramIndex(), [1, 2, 3]
    assert index.propose(ids, 2) == []
    ids += [1, 2]
    assert index.propose(ids, 2) == [3, 1]
    ids += [8]
    assert index.propose(ids, 2) == []
    ids += [1, 2]
    assert index.propose(ids, 2) == [8, 1]  # the latest match wins


def mixed_prompts(seed: int, vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (drafts found and often right) and random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(8):
        period = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        prompts.append(period * rng.randint(3, 8) if i % 2 == 0 else
                       [rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))])  # fmt: skip
    return prompts


def run_both(model: str, prompts, sampling, speculative=None, **options):
    speculative = speculative or {"speculative": "ngram"}
    plain = Engine(model, dtype="float32", **options).generate(
        input_ids=prompts, sampling_params=sampling
    )
    spec_engine = Engine(model, dtype="float32", **speculative, **options)
    spec = spec_engine.generate(input_ids=prompts, sampling_params=sampling)
    return plain, spec, spec_engine


@pytest.mark.parametrize(
    "model, options",
    [
        ("random:tiny-llama", {}),
        ("random:tiny-qwen2", {"page_size": 4}),
        ("random:tiny-mistral", {"chunked_prefill_size": 16}),
        ("random:tiny-llama", {"page_size": 2, "disable_radix_cache": True}),
        # A pool this small retracts requests mid-decode and recomputes them.
        ("random:tiny-llama", {"max_total_tokens": 160, "max_running_requests": 8}),
    ],
)
def test_greedy_output_equals_plain_decoding_in_mixed_batches(model, options):
    prompts = mixed_prompts(7, 500)
    sampling = [{**GREEDY, "max_new_tokens": 8 + 5 * i} for i in range(len(prompts))]
    plain, spec, engine = run_both(model, prompts, sampling, **options)
    for a, b in zip(plain, spec, strict=True):
        assert b["output_ids"] == a["output_ids"]
        assert b["finish_reason"] == a["finish_reason"] == "length"
    assert engine.scheduler.drafter.accepted > 0  # drafts were verified, and some held
    assert engine.scheduler.runner.allocator.num_free_pages() + _cached_pages(engine) == (
        engine.scheduler.runner.allocator.num_pages
    )  # rejected drafts gave their KV back


def _cached_pages(engine: Engine) -> int:
    cache = engine.scheduler.kv.prefix_cache
    return 0 if cache is None else cache.total_size() // engine.scheduler.runner.page_size


DRAFT_MODEL = {"speculative": "draft", "draft_model": "random:nano-llama"}
SELF_DRAFT = {"speculative": "draft", "draft_model": "random:tiny-llama"}


@pytest.mark.parametrize(
    "options",
    [{}, {"page_size": 4, "chunked_prefill_size": 16},
     {"max_total_tokens": 160, "max_running_requests": 8}],
)  # fmt: skip
def test_greedy_output_with_a_draft_model_equals_plain_decoding(options):
    prompts = mixed_prompts(11, 500)
    sampling = [{**GREEDY, "max_new_tokens": 8 + 5 * i} for i in range(len(prompts))]
    plain, spec, engine = run_both("random:tiny-llama", prompts, sampling, DRAFT_MODEL, **options)
    for a, b in zip(plain, spec, strict=True):
        assert b["output_ids"] == a["output_ids"]
    assert engine.scheduler.drafter.drafted > 0


def test_the_target_as_its_own_draft_has_every_draft_accepted():
    prompts = mixed_prompts(5, 500)
    sampling = {**GREEDY, "max_new_tokens": 24}
    plain, spec, engine = run_both("random:tiny-llama", prompts, sampling, SELF_DRAFT)
    for a, b in zip(plain, spec, strict=True):
        assert b["output_ids"] == a["output_ids"]
    drafter = engine.scheduler.drafter
    assert drafter.drafted > 0 and drafter.accepted == drafter.drafted


def test_a_draft_model_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        Engine("random:tiny-llama", speculative="draft", draft_model="random:tiny-qwen2")
    with pytest.raises(ValueError, match="draft_model"):
        Engine("random:tiny-llama", speculative="draft")


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    prompts = mixed_prompts(3, 500)
    reference = Engine("random:tiny-llama", dtype="float32").generate(
        input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 40}
    )
    # Stop at each request's 6th token, which drafts are likely to have run past.
    sampling = [
        {**GREEDY, "max_new_tokens": 40, "stop_token_ids": [ref["output_ids"][5]]}
        for ref in reference
    ]
    plain, spec, _ = run_both("random:tiny-llama", prompts, sampling)
    for a, b in zip(plain, spec, strict=True):
        assert b["output_ids"] == a["output_ids"]
        assert (b["finish_reason"], b["matched_stop"]) == (a["finish_reason"], a["matched_stop"])
        assert len(b["output_ids"]) <= 6


def test_usage_reports_the_accepted_tokens_per_step():
    engine = Engine("random:tiny-llama", dtype="float32", speculative="ngram")
    out = engine.generate(input_ids=[5, 9, 5, 9, 5, 9, 5, 9],
                          sampling_params={**GREEDY, "max_new_tokens": 30})  # fmt: skip
    usage = out["usage"]
    # The prompt repeats, and so does this model's greedy output: drafts are taken.
    assert 0 < usage["accepted_draft_tokens"] <= usage["draft_tokens"]
    assert usage["accepted_tokens_per_step"] > 1.0
    plain = Engine("random:tiny-llama", dtype="float32").generate(
        input_ids=[5, 9, 5, 9, 5, 9, 5, 9], sampling_params={**GREEDY, "max_new_tokens": 30}
    )
    assert "draft_tokens" not in plain["usage"]


def test_bad_speculative_options_name_the_field():
    with pytest.raises(ValueError, match="speculative"):
        Engine("random:tiny-llama", speculative="medusa")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Engine("random:tiny-llama", speculative="ngram", num_draft_tokens=0)


# ---- sampling keeps the target distribution ------------------------------------------------

SAMPLES = 400
POSITIONS = 6


def _counts(engine: Engine, prompt: list[int], temperature: float, seeds: range) -> list[Counter]:
    out = engine.generate(
        input_ids=[prompt] * SAMPLES,
        sampling_params=[{"max_new_tokens": POSITIONS, "temperature": temperature,
                          "ignore_eos": True, "seed": seed} for seed in seeds],
    )  # fmt: skip
    return [Counter(o["output_ids"][p] for o in out) for p in range(POSITIONS)]


def chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic on equal-size samples, bins under 5 merged."""
    total = a + b
    small = {t for t, n in total.items() if n < 10}
    a = Counter({("rare" if t in small else t): n for t, n in a.items()})
    b = Counter({("rare" if t in small else t): n for t, n in b.items()})
    bins = set(a) | set(b)
    stat = sum((a[t] - b[t]) ** 2 / (a[t] + b[t]) for t in bins if a[t] + b[t])
    return stat, max(len(bins) - 1, 1)


def critical_value(df: int, z: float = 3.72) -> float:
    """Chi-square quantile at p = 1e-4 (z), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "prompt, speculative",
    [
        ([6] * 12, {"speculative": "ngram"}),
        ([3, 4, 5, 6] * 8, {"speculative": "ngram"}),
        ([3, 4, 5, 6] * 8, {"speculative": "draft", "draft_model": "random:micro-llama-draft"}),
    ],
)
def test_sampled_tokens_keep_the_target_distribution(prompt, speculative):
    """A 16-token model at a temperature where drafts are sometimes right: each output
    position's distribution with speculation matches plain sampling, while the drafts'
    own distribution (what an accept-always rule would give) is far from it."""
    temperature = 0.15
    plain_engine = Engine("random:micro-llama", dtype="float32", disable_radix_cache=True)
    plain = _counts(plain_engine, prompt, temperature, range(SAMPLES))
    spec_engine = Engine("random:micro-llama", dtype="float32", disable_radix_cache=True,
                         **speculative)  # fmt: skip
    # Verify every draft, whatever steps cost: this is about what acceptance emits.
    spec_engine.scheduler.drafter.costs.verify_pays = lambda *_: True
    spec = _counts(spec_engine, prompt, temperature, range(SAMPLES, 2 * SAMPLES))
    for position in range(POSITIONS):
        stat, df = chi_square(plain[position], spec[position])
        assert stat < critical_value(df), (position, plain[position], spec[position])
    assert spec_engine.scheduler.drafter.accepted > SAMPLES // 4  # acceptance is exercised
    assert spec_engine.scheduler.drafter.acceptance_rate() < 0.95  # and rejection
    if speculative["speculative"] == "ngram":
        # The test has power: accepting every draft makes the last position the drafts' own.
        drafts = Counter({NgramIndex().propose(prompt, 1)[0]: SAMPLES})
        stat, df = chi_square(plain[-1], drafts)
        assert stat > critical_value(df)
