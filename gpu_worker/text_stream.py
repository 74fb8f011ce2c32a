"""TextStream: incremental detokenization that never leaks a stop string.

Decoding, as vLLM and SGLang do it: a token's text depends on its neighbours (SentencePiece
drops the space of the first token of a string; a character may span several byte tokens),
so each push decodes a short window `ids[prefix_offset:]` and keeps only what it adds beyond
`decode(ids[prefix_offset:read_offset])`, text that was already handed out. When the window
ends in U+FFFD (a character whose bytes have not all arrived) the offsets stay put and only
the text before the trailing U+FFFD is released; the next push decodes the same window again,
longer. So a push costs O(new tokens), and with no stop string the concatenated text equals
`tokenizer.decode(output_ids)` for byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2).

With `prompt_ids`, the window starts with the last few prompt tokens, so the first output
token is decoded in context: a SentencePiece tokenizer then keeps the space that begins it
(text continues the prompt, as in vLLM and SGLang) where `decode(output_ids)` would drop it.

Stop strings: decoded text goes to `_pending` first. Text is released only up to the longest
suffix of `_pending` that could still begin a stop string, so a stop string split across
tokens is found before any of it is emitted; when one completes, everything from its start
on is dropped and the stream is stopped.

Cost: a push matches stop strings over `_pending` only (the held-back tail, shorter than the
longest stop string, plus the new text), and the emitted text is kept as a list of pieces
joined on demand (`text`): an attribute grown with += is copied whole on every push, which
made a long output quadratic.
"""

from __future__ import annotations

from typing import Any

from jobs.protocol import PROMPT_CONTEXT_TOKENS
from jobs.stop_strings import find_stop, stop_prefix_len

REPLACEMENT_CHAR = "\ufffd"


class TextStream:
    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        skip_special_tokens: bool = True,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self._emitted: list[str] = []  # everything emitted so far, piece by piece
        self.stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the stream
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._released_in_window = 0  # chars of the current window's new text already released
        self._pending = ""  # decoded, but it could still be the start of a stop string
        if prompt_ids:
            context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
            # A prompt cut inside a character would make the window's prefix text end in
            # U+FFFD and swallow the character's completion: decode without context then.
            if not self._decode(context).endswith(REPLACEMENT_CHAR):
                self._ids = context
                self._read_offset = len(context)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """Add output tokens; return (new text safe to emit, whether a stop string hit)."""
        if self.stopped:
            return "", True
        self._ids.extend(token_ids)
        return self._release(self._decode_new(final=False))

    def flush(self) -> str:
        """At a finish without a stop string: release held-back text (a trailing partial
        character comes out as U+FFFD, as decode gives it). A stop string completed only by
        that text still cuts it."""
        if self.stopped:
            return ""
        text, _ = self._release(self._decode_new(final=True), final=True)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """The text the window adds that has not been released yet."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])[len(prefix_text) :]
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            # Incomplete character at the end: release what precedes it, keep the window.
            settled = new_text.rstrip(REPLACEMENT_CHAR)
            released = settled[self._released_in_window :]
            self._released_in_window = max(self._released_in_window, len(settled))
            return released
        released = new_text[self._released_in_window :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._released_in_window = 0
        return released

    def _release(self, new_text: str, final: bool = False) -> tuple[str, bool]:
        pending = self._pending + new_text
        if not self.stop:
            self._pending = ""
            self._emitted.append(pending)
            return pending, False
        # A stop string lies wholly inside `pending`: earlier text was released only when no
        # suffix of it could begin one.
        hit = find_stop(pending, self.stop)
        if hit is not None:
            at, self.matched_stop = hit
            self.stopped = True
            self._pending = ""
            self._emitted.append(pending[:at])
            return pending[:at], True
        keep = 0 if final else stop_prefix_len(pending, self.stop)
        emit = pending[: len(pending) - keep]
        self._pending = pending[len(pending) - keep :]
        self._emitted.append(emit)
        return emit, False
