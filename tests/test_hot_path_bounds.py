"""What a hostile request could make every step cost: stop-string matching stays linear in
the text, and logit_bias is applied as tensors built once per request."""

from __future__ import annotations

import random
import statistics
import time

import torch

import gpu_worker.text_stream as text_stream_module
from gpu_worker.sampling.logit_bias import LogitBias
from gpu_worker.sampling.penalties import LogitAdjustments, SamplingRows
from gpu_worker.text_stream import TextStream
from jobs.sampling_params import SamplingParams
from jobs.stop_strings import stop_prefix_len


class OneCharTokenizer:
    """Token t decodes to chr(97 + t % 2): 'a' and 'b', the worst case for stop prefixes."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("ab"[t % 2] for t in ids)


def scanned_chars(monkeypatch, tokens: int, stop: list[str]) -> int:
    """Characters the stop checks of a TextStream look at over `tokens` pushes."""
    seen = {"chars": 0}
    find, prefix = text_stream_module.find_stop, text_stream_module.stop_prefix_len

    def counting_find(text, stops):
        seen["chars"] += len(text)
        return find(text, stops)

    def counting_prefix(text, stops):
        seen["chars"] += len(text)
        return prefix(text, stops)

    monkeypatch.setattr(text_stream_module, "find_stop", counting_find)
    monkeypatch.setattr(text_stream_module, "stop_prefix_len", counting_prefix)
    stream = TextStream(OneCharTokenizer(), stop)
    for _ in range(tokens):
        stream.push([0])  # 'a' forever: every suffix could begin the stop string
    assert not stream.stopped and len(stream.text) + len(stop[0]) - 1 == tokens
    return seen["chars"]


def test_stop_matching_work_is_linear_in_the_output(monkeypatch):
    stop = ["a" * 200 + "b"]
    small = scanned_chars(monkeypatch, 2_000, stop)
    large = scanned_chars(monkeypatch, 8_000, stop)
    # Each push looks at the held-back tail (< 201 chars) and its new text, never the whole.
    assert large <= 4 * small * 1.1
    assert large <= 8_000 * 2 * 201


def test_a_push_costs_the_same_after_two_million_characters_of_output():
    """Each push appends its text: one grown with += copied the whole output every token.
    Pushes to a fresh stream and to a long one alternate, so load on the machine hits both;
    medians, so a stall does not count. The old copy made the long one's ~10x slower."""
    fresh, long = TextStream(OneCharTokenizer(), ["ab"]), TextStream(OneCharTokenizer(), ["ab"])
    long.push([0] * 2_000_000)
    long.push([0])  # the window after the big push is decoded once more, then stays small
    times: dict[int, list[float]] = {id(fresh): [], id(long): []}
    for _ in range(2_000):
        for stream in (fresh, long):
            started = time.perf_counter()
            stream.push([0])
            times[id(stream)].append(time.perf_counter() - started)
    assert statistics.median(times[id(long)]) < 2 * statistics.median(times[id(fresh)])
    assert len(long.text) == 2_002_000


def test_stop_prefix_len_matches_the_definition():
    rng = random.Random(0)
    for _ in range(5_000):  # up to 30 characters: past a few candidates, KMP takes over
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 14))) for _ in range(3)]
        expected = max(
            (n for s in stops for n in range(len(s)) if n <= len(text) and text.endswith(s[:n])),
            default=0,
        )
        assert stop_prefix_len(text, stops) == expected, (text, stops)


def test_many_logit_bias_entries_edit_the_logits_as_a_dense_add():
    vocab, rng = 1_000, torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=rng)
    tokens = torch.randperm(vocab, generator=rng)[:300].tolist()
    values = (torch.rand(300, generator=rng) * 200 - 100).tolist()
    bias = dict(zip(tokens, values, strict=True))
    params = [SamplingParams(logit_bias=bias), SamplingParams(), SamplingParams(logit_bias=bias)]
    rows = SamplingRows(params, [[1]] * 3, [[]] * 3, [[]] * 3,
                        biases=[LogitBias.of(p) for p in params])  # fmt: skip
    edited = LogitAdjustments.build(rows, vocab, "cpu").apply(logits.clone())
    dense = torch.zeros(vocab)
    dense[list(bias)] = torch.tensor(list(bias.values()))
    assert torch.equal(edited[0], logits[0] + dense)
    assert torch.equal(edited[1], logits[1])
    assert torch.equal(edited[2], logits[2] + dense)
    # Greedy sampling picks what it picked when the bias was added entry by entry.
    assert (
        edited.argmax(-1).tolist()
        == (logits + torch.stack([dense, 0 * dense, dense])).argmax(-1).tolist()
    )
