"""Text deltas as a pure function of one token item, so any detokenizer replica can serve any
engine step of any request, in any order.

Let E(n) be the text a client holds after a request's first n output tokens: the decoded
output with (a) a trailing incomplete UTF-8 character held back, (b) everything from the
first stop string on cut, and (c) while the request runs, the longest suffix that could
still begin a stop string held back. The delta for tokens start..start+len(ids) is
E(start + len(ids)) minus E(start). Both are computed from one short window: ``context``
(the tokens just before ``ids``) decoded with and without ``ids``. Whatever the window's
first characters decode to (a cut character, a SentencePiece space) is the same in both
decodes and cancels, so the delta equals what decoding from the first token would give,
as long as the window spans the held-back text: the worker sizes ``context`` from the
longest stop string (gpu_worker/token_item.py's `stop_window`). The rules are TextStream's
(gpu_worker/text_stream.py), which the worker runs to find stop strings.

While ``start`` is small the context also holds the last prompt tokens, decoded as a prefix
whose text is not output: the first output token then decodes in context, as in TextStream.
"""

from __future__ import annotations

from typing import Any

from jobs.protocol import TokenItem
from jobs.stop_strings import find_stop, stop_prefix_len
from jobs.token_records import ENDED_SHORT

REPLACEMENT_CHAR = "\ufffd"


def text_deltas(tokenizer: Any, items: list[TokenItem]) -> list[str]:
    """The text each item adds, with one batched decode per skip_special_tokens value."""
    windows = [(window, item.skip_special_tokens) for item in items for window in _windows(item)]
    texts = _decode_windows(tokenizer, windows)
    return [_delta(tokenizer, item, texts[3 * i : 3 * i + 3]) for i, item in enumerate(items)]


def _windows(item: TokenItem) -> tuple[list[int], list[int], list[int]]:
    """(prompt prefix, context, context + ids)."""
    prompt_part = item.context[: item.prompt_context]
    return prompt_part, item.context, item.context + item.ids


def _decode_windows(tokenizer: Any, windows: list[tuple[list[int], bool]]) -> list[str]:
    texts = [""] * len(windows)
    for flag in (True, False):
        chosen = [i for i, (_, skip) in enumerate(windows) if skip is flag]
        if chosen:
            decoded = tokenizer.decode_batch([windows[i][0] for i in chosen], flag)
            for i, text in zip(chosen, decoded, strict=True):
                texts[i] = text
    return texts


def _delta(tokenizer: Any, item: TokenItem, texts: list[str]) -> str:
    prefix, old, new = texts
    if item.prompt_context and prefix.endswith(REPLACEMENT_CHAR):
        # A prompt cut inside a character would swallow its completion: decode without it,
        # as TextStream does.
        before = item.context[item.prompt_context :]
        prefix = ""
        old, new = tokenizer.decode_batch([before, before + item.ids], item.skip_special_tokens)
    final = item.finish is not None and item.finish.reason not in ENDED_SHORT
    old_visible = _visible(old[len(prefix) :], item.stop, final=False)
    new_visible = _visible(new[len(prefix) :], item.stop, final=final)
    return new_visible[len(old_visible) :]


def _visible(text: str, stop: list[str], final: bool) -> str:
    """What of `text` a client may hold: E() of the module docstring, on a window."""
    if not final:
        text = text.rstrip(REPLACEMENT_CHAR)
    if not stop:
        return text
    hit = find_stop(text, stop)
    if hit is not None:
        return text[: hit[0]]
    return text if final else text[: len(text) - stop_prefix_len(text, stop)]
