"""The detokenizer's deltas: a pure function of each token item, so replicas can serve a
request's steps in any order, and their concatenation is what TextStream (the in-process
engine's detokenizer) emits for the same tokens."""

from __future__ import annotations

import random

import pytest

from gpu_worker.text_stream import TextStream
from gpu_worker.token_item import CONTEXT_TOKENS
from jobs.protocol import Finish, TokenItem, token_context
from jobs.stop_strings import stop_window_tokens
from stages.detokenizer.incremental import text_deltas

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "Émile a mangé des crêpes à Besançon — très bon !",
    "東京は日本の首都です。人口は多いです。",
    "Emoji: 🎉🚀👩‍👩‍👧 and math ∑∫√ ok",
    "def f(x):\n    return x  # comment\n\n\nprint(f(3))",
    "   leading spaces and\ttabs\t\tand trailing   ",
]


class HFTokenizer:
    """transformers' tokenizer behind the two methods the detokenizer calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.tokenizer.decode(s, skip_special_tokens=skip_special_tokens) for s in seqs]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return HFTokenizer(default_tokenizer)


def items_for(prompt, output, chunks, stop, finish_reason="length"):
    """The TokenItems a worker publishes for `output` produced in `chunks`-sized steps."""
    window = stop_window_tokens(stop, CONTEXT_TOKENS)
    items, start = [], 0
    for size in chunks:
        end = min(len(output), start + size)
        context, prompt_context = token_context(prompt, output, start, window)
        item = TokenItem("r", "reply", start, output[start:end], context, prompt_context, stop)
        if end == len(output):
            item.finish = Finish(finish_reason, None, len(prompt), len(output))
        items.append(item)
        start = end
        if end == len(output):
            break
    return items


def text_stream_text(hf, prompt, output, stop):
    stream = TextStream(hf, stop, prompt_ids=prompt)
    for token in output:
        _, stopped = stream.push([token])
        if stopped:
            return stream.text
    stream.flush()
    return stream.text


def random_chunks(rng, n):
    return [rng.choice([1, 1, 1, 2, 3, 5]) for _ in range(n)]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_in_any_order_join_to_the_decoded_output(tokenizer, default_tokenizer, text):
    rng = random.Random(text)
    prompt = default_tokenizer.encode("Say something:")
    output = default_tokenizer.encode(text, add_special_tokens=False)
    items = items_for(prompt, output, random_chunks(rng, len(output)), [])
    order = list(range(len(items)))
    rng.shuffle(order)  # replicas race: each item is decoded with no knowledge of the others
    deltas = dict(zip(order, text_deltas(tokenizer, [items[i] for i in order]), strict=True))
    joined = "".join(deltas[i] for i in range(len(items)))
    assert joined == default_tokenizer.decode(output, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_match_text_stream_one_token_at_a_time(tokenizer, default_tokenizer, text):
    prompt = default_tokenizer.encode("Continue:")
    output = default_tokenizer.encode(text, add_special_tokens=False)
    items = items_for(prompt, output, [1] * len(output), [])
    assert "".join(text_deltas(tokenizer, items)) == text_stream_text(
        default_tokenizer, prompt, output, []
    )


def test_partial_character_is_held_back_until_it_completes(tokenizer, default_tokenizer):
    output = default_tokenizer.encode("🎉", add_special_tokens=False)
    assert len(output) > 1, "the test needs a character split over byte tokens"
    items = items_for([1, 2, 3], output, [1] * len(output), [])
    deltas = text_deltas(tokenizer, items)
    assert deltas[:-1] == [""] * (len(output) - 1)
    assert deltas[-1] == "🎉"


@pytest.mark.parametrize(
    "stop",
    [["Paris"], ["is known"], ["Tower.", "capital"], ["Eiffel Tower. It"], ["nowhere"], ["."]],
)
def test_stop_strings_are_never_leaked_and_cut_as_text_stream_does(
    tokenizer, default_tokenizer, stop
):
    text = TEXTS[0]
    prompt = default_tokenizer.encode("Tell me.")
    output = default_tokenizer.encode(text, add_special_tokens=False)
    expected = text_stream_text(default_tokenizer, prompt, output, stop)
    # The worker ends the request at the token that completes the stop string.
    stream, cut = TextStream(default_tokenizer, stop, prompt_ids=prompt), len(output)
    for i, token in enumerate(output):
        if stream.push([token])[1]:
            cut = i + 1
            break
    reason = "stop" if cut < len(output) or stream.stopped else "length"
    for chunks in ([1] * cut, random_chunks(random.Random(str(stop)), cut)):
        items = items_for(prompt, output[:cut], chunks, stop, finish_reason=reason)
        deltas = text_deltas(tokenizer, items)
        assert "".join(deltas) == expected
        for i in range(len(deltas)):
            partial = "".join(deltas[: i + 1])
            assert not any(s in partial for s in stop)


def test_a_long_stop_string_is_held_back_across_a_window_longer_than_the_default(
    tokenizer, default_tokenizer
):
    text = "one two three four five six seven eight nine ten eleven twelve thirteen"
    stop = ["three four five six seven eight nine ten eleven twelve thirteen fourteen"]
    output = default_tokenizer.encode(text, add_special_tokens=False)
    items = items_for([1], output, [1] * len(output), stop, finish_reason="length")
    deltas = text_deltas(tokenizer, items)
    # Nothing of the possible stop string leaks while it could still complete ...
    assert "".join(deltas[:-1]) == "one two "
    # ... and at the finish without a stop the held-back text comes out.
    assert "".join(deltas) == text


def test_abort_releases_nothing_held_back(tokenizer, default_tokenizer):
    output = default_tokenizer.encode("Hello wor", add_special_tokens=False)
    items = items_for([1], output, [1] * len(output), ["world"], finish_reason="abort")
    assert "".join(text_deltas(tokenizer, items)) == "Hello "


@pytest.mark.parametrize("seed", range(20))
def test_random_ids_split_anywhere_join_to_what_text_stream_emits(
    tokenizer, default_tokenizer, seed
):
    # Random ids (byte tokens among them) cut characters and start windows mid-character
    # far more often than text does: the context each item carries must still span it all.
    # Text passes with 5 tokens of context; these fail below 8 (3 of 60 seeds at 6).
    rng = random.Random(seed)
    vocab = len(default_tokenizer)
    bytes_first = [i for i in range(vocab) if default_tokenizer.convert_ids_to_tokens(i)
                   in ("Ã", "â", "ð", "Ł", "ĵ", "¤")][:40] or list(range(vocab))  # fmt: skip
    output = [rng.choice(bytes_first) if rng.random() < 0.4 else rng.randrange(vocab)
              for _ in range(120)]  # fmt: skip
    prompt = [rng.randrange(vocab) for _ in range(8)]
    items = items_for(prompt, output, random_chunks(rng, len(output)), [])
    assert "".join(text_deltas(tokenizer, items)) == text_stream_text(
        default_tokenizer, prompt, output, []
    )
