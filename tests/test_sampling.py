"""SamplingParams validation and the batched sampler: processing order, penalty formulas,
filters, seeded reproducibility and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.sampling.penalties import LogitAdjustments, SamplingRows
from gpu_worker.sampling.sampler import SamplingBatch, sample
from jobs.sampling_params import (
    SamplingParamError,
    SamplingParams,
    _checked_wire_cached,
    wire_sampling,
)

VOCAB = 50


def make_batch(
    params: list[SamplingParams],
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    blocked: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab_size: int = VOCAB,
) -> SamplingBatch:
    bs = len(params)
    rows = SamplingRows(
        params,
        prompt_ids or [[] for _ in range(bs)],
        output_ids or [[] for _ in range(bs)],
        blocked or [[] for _ in range(bs)],
    )
    return SamplingBatch.build(
        rows,
        generators or [None] * bs,
        vocab_size,
        "cpu",
    )


def adjusted(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]):
    rows = SamplingRows([params], [prompt], [output], [[]])
    adjustments = LogitAdjustments.build(rows, logits.shape[-1], "cpu")
    return adjustments.apply(logits.clone().unsqueeze(0))[0]


# ---- SamplingParams ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", -3),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("stop_token_ids", [VOCAB]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {VOCAB: 1.0}),
        ("logit_bias", {"3": 150.0}),
        ("stop", [""]),
        ("stop", [f"s{i}" for i in range(17)]),
        ("top_logprobs", 21),
        ("seed", -1),
        ("seed", 2**63),
    ],
)
def test_out_of_range_value_is_rejected_naming_the_field(field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    params = SamplingParams.from_dict({field: value, **extra})
    with pytest.raises(ValueError, match=field):
        params.validate(VOCAB)


def test_min_new_tokens_above_max_new_tokens_is_rejected():
    params = SamplingParams.from_dict({"max_new_tokens": 4, "min_new_tokens": 5})
    with pytest.raises(ValueError, match="min_new_tokens"):
        params.validate(VOCAB)


def test_top_logprobs_without_logprobs_is_rejected():
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams.from_dict({"top_logprobs": 3}).validate(VOCAB)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", "5"),
        ("max_new_tokens", 5.0),
        ("max_new_tokens", True),
        ("temperature", "hot"),
        ("top_k", 2.5),
        ("seed", "42"),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop_token_ids", "2"),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"3": "high"}),
        ("logit_bias", {"1" * 5000: 1.0}),  # more digits than int() takes
        ("logit_bias", {"3": 10**400}),  # past any float
        ("ignore_eos", 1),
        ("logprobs", "yes"),
    ],
)
def test_wrong_type_is_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_unknown_key_is_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter 'xyz'"):
        SamplingParams.from_dict({"xyz": 1})


def test_from_dict_normalises_json_shapes():
    params = SamplingParams.from_dict({"stop": "END", "logit_bias": {"7": 5, 3: -1.5}})
    params.validate(VOCAB)
    assert params.stop == ["END"]
    assert params.logit_bias == {7: 5.0, 3: -1.5}
    assert SamplingParams.from_dict(None) == SamplingParams()


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"top_p": 0.0}, "top_p"),  # a range
        ({"seed": "42"}, "seed"),  # a type
        ({"stop": [""]}, "stop"),
        ({"xyz": 1}, "xyz"),  # unknown
        ({"top_k": 2**64}, "top_k"),  # past what msgpack carries
    ],
)
def test_a_bad_value_raises_an_error_carrying_its_field(sampling, field):
    with pytest.raises(SamplingParamError) as caught:
        wire_sampling(sampling)
    assert caught.value.field == field


def test_from_wire_defaults_max_new_tokens_only_where_the_client_gave_none():
    assert SamplingParams.from_wire({}, default_max_new_tokens=900).max_new_tokens == 900
    given = SamplingParams.from_wire({"max_new_tokens": 7}, default_max_new_tokens=900)
    assert given.max_new_tokens == 7


def test_wire_form_keeps_only_the_fields_given():
    assert wire_sampling({"temperature": 0, "stop": "x"}) == {"temperature": 0, "stop": ["x"]}


def test_a_map_of_scalars_checked_again_is_checked_the_same_and_answers_a_copy():
    # The checks of a map of scalars are kept (jobs/sampling_params.py): a repeat must answer
    # as the first did, an error again, and a wire form its caller may change.
    first = wire_sampling({"stop": "x", "max_new_tokens": 5})
    first["stop"].append("y")
    first["max_new_tokens"] = 6
    assert wire_sampling({"stop": "x", "max_new_tokens": 5}) == {"stop": ["x"], "max_new_tokens": 5}
    for _ in range(2):
        with pytest.raises(SamplingParamError, match="temperature"):
            wire_sampling({"temperature": True})  # equal to 1, but not a number here
        with pytest.raises(SamplingParamError, match="temperature"):
            wire_sampling({"temperature": -1.0})
    assert wire_sampling({"temperature": 1}) == {"temperature": 1.0}
    # A long string (a grammar, a stop string) is checked each time, not kept: whatever
    # clients send, what is kept stays small.
    kept = _checked_wire_cached.cache_info().currsize
    long_stop = "y" * 200
    assert wire_sampling({"stop": long_stop}) == {"stop": [long_stop]}
    assert _checked_wire_cached.cache_info().currsize == kept


def test_is_greedy_for_zero_temperature_or_top_k_one():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy


# ---- greedy and the fast path -----------------------------------------------------------


def test_all_greedy_batch_takes_the_fast_path_and_equals_argmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    batch = make_batch([SamplingParams(temperature=0.0)] * 4)
    assert batch.adjustments is None and not batch.sampled_rows
    out = sample(logits, batch, torch.Generator())
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4 and out.top_logprobs == [None] * 4


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    out = sample(
        logits,
        make_batch([SamplingParams(temperature=2.0, top_k=1)] * 3),
        torch.Generator().manual_seed(0),
    )
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_stay_argmax_next_to_sampled_rows():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5),
    ]
    out = sample(logits, make_batch(params), torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    assert [out.next_token_ids[0], out.next_token_ids[2]] == [expected[0], expected[2]]


def test_sample_does_not_modify_the_callers_logits():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.5, logit_bias={0: 5.0}, top_k=5)
    sample(logits, make_batch([params] * 2, output_ids=[[1, 2], [3]]), torch.Generator())
    assert torch.equal(logits, before)


# ---- logit edits ------------------------------------------------------------------------


def test_logit_bias_forces_a_token():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    weakest = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logit_bias={weakest: 100.0}),
        SamplingParams(logit_bias={weakest: 100.0}),
    ]
    out = sample(logits, make_batch(params), torch.Generator().manual_seed(0))
    assert out.next_token_ids[0] == weakest
    assert out.next_token_ids[1] == weakest  # exp(100) outweighs every other token


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    # Token 0 is in the prompt, token 1 in the output; 2 and 3 are unseen.
    result = adjusted(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1])
    assert result.tolist() == [1.0, -2.0, 0.5, 3.0]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    # l -= count * 0.5 + (count > 0) * 1.0; token 3 is only in the prompt.
    result = adjusted(logits, params, prompt=[3, 3], output=[0, 0, 2])
    assert result.tolist() == [1.0, 1.0, 0.5, 0.0]


def test_negative_presence_penalty_encourages_repeats():
    logits = torch.tensor([1.0, 1.5])
    result = adjusted(logits, SamplingParams(presence_penalty=-1.0), prompt=[], output=[0])
    assert result.tolist() == [2.0, 1.5]


def test_logit_bias_applies_before_repetition_penalty():
    logits = torch.tensor([-0.5, 0.0])
    params = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0)
    # (-0.5 + 1.0) is positive by the time the penalty sees it: 0.5 / 2.
    assert adjusted(logits, params, prompt=[0], output=[]).tolist() == [0.25, 0.0]


def test_min_new_tokens_masks_eos_until_reached():
    eos = 7
    logits = torch.zeros(2, VOCAB)
    logits[:, eos] = 10.0
    params = [SamplingParams(temperature=0.0, min_new_tokens=3)] * 2
    out = sample(logits, make_batch(params, blocked=[[eos], []]), torch.Generator())
    assert out.next_token_ids[0] != eos
    assert out.next_token_ids[1] == eos


# ---- filters and the draw ---------------------------------------------------------------

# Probabilities in a shuffled order, so a filter that ignores the sort would show.
PROBS = {4: 0.4, 9: 0.25, 1: 0.15, 30: 0.1, 12: 0.06, 20: 0.04}


def draws(params: SamplingParams, rows: int = 400, steps: int = 5) -> list[int]:
    logits = torch.full((VOCAB,), -math.inf)
    for token, p in PROBS.items():
        logits[token] = math.log(p)
    logits = logits.expand(rows, VOCAB).contiguous()
    generator = torch.Generator().manual_seed(0)
    batch = make_batch([params] * rows)
    return [t for _ in range(steps) for t in sample(logits, batch, generator).next_token_ids]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {4, 9, 1}),
        # Mass before each sorted token: 0, .4, .65, .8 -> top_p=0.7 keeps three.
        (SamplingParams(top_p=0.7), {4, 9, 1}),
        (SamplingParams(top_p=0.3), {4}),
        # min_p * p_max = 0.1: keeps p >= 0.1.
        (SamplingParams(min_p=0.25), {4, 9, 1, 30}),
        (SamplingParams(top_k=4, top_p=0.5), {4, 9}),
        (SamplingParams(top_k=5, min_p=0.3), {4, 9, 1}),
    ],
)
def test_filters_sample_only_and_all_of_their_allowed_set(params, allowed):
    assert set(draws(params)) == allowed


def test_draw_frequencies_follow_the_tempered_distribution():
    tokens = draws(SamplingParams(temperature=0.5))
    # p_i^(1/T) renormalised, T = 0.5: squares of the probabilities.
    squared = {t: p * p for t, p in PROBS.items()}
    total = sum(squared.values())
    for token, weight in squared.items():
        assert abs(tokens.count(token) / len(tokens) - weight / total) < 0.03


# ---- seeds ------------------------------------------------------------------------------


def seeded_run(seed: int, neighbours: list[SamplingParams], position: int, steps: int = 12):
    """Tokens of the seeded request when it sits at `position` among `neighbours`."""
    mine = SamplingParams(seed=seed, top_p=0.95, temperature=1.3)
    params = neighbours[:position] + [mine] + neighbours[position:]
    generators = [None] * len(params)
    generators[position] = torch.Generator().manual_seed(seed)
    logits_source = torch.Generator().manual_seed(99)
    default = torch.Generator().manual_seed(len(neighbours))
    tokens = []
    for _ in range(steps):
        step_logits = torch.randn(len(params), VOCAB, generator=logits_source)
        mine_logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(len(tokens)))
        step_logits[position] = mine_logits
        out = sample(step_logits, make_batch(params, generators=generators), default)
        tokens.append(out.next_token_ids[position])
    return tokens


def test_same_seed_gives_same_tokens_with_different_batch_neighbours():
    alone = seeded_run(1234, [], 0)
    crowded = seeded_run(
        1234,
        [
            SamplingParams(),
            SamplingParams(temperature=0.0),
            SamplingParams(top_k=3),
            SamplingParams(seed=5, min_p=0.2, repetition_penalty=1.3),
        ],
        2,
    )
    assert alone == crowded


def test_different_seeds_give_different_tokens():
    assert seeded_run(1, [], 0) != seeded_run(2, [], 0)


# ---- logprobs ---------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits_and_top_logprobs_are_sorted():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(
            logprobs=True,
            top_logprobs=5,
            temperature=0.7,
            repetition_penalty=1.5,
            logit_bias={3: 4.0},
        ),
        SamplingParams(),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    out = sample(
        logits, make_batch(params, output_ids=[[1, 2], [], []]), torch.Generator().manual_seed(0)
    )
    raw = torch.log_softmax(logits, dim=-1)
    for row in (0, 2):
        assert out.logprobs[row] == pytest.approx(raw[row, out.next_token_ids[row]].item())
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(raw[0].topk(5).values.tolist())
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] is None
