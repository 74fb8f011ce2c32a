"""Stop-string matching, shared by the worker's TextStream and the detokenizer stage so both
cut a request's text at the same place.

Cost: callers pass only the text that can hold a new match (the held-back tail plus the new
text), never the whole output. `stop_prefix_len` looks only at the last len(s) - 1
characters for each stop string s, and tries the positions where s's first character
occurs, longest suffix first, each one C-level comparison; past a few such positions
(text built to match many of them) it runs a KMP automaton instead, so a step costs
O(len(s)) per stop string, where testing each prefix length with `endswith` cost O(len(s)²)
(docs/BOUNDS.md bounds the stop strings' lengths too).
"""

from __future__ import annotations

import functools

# Positions of a stop string's first character tried one by one before KMP takes over.
CANDIDATES_BEFORE_KMP = 8


def find_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text`, as (position, stop string); None if none."""
    return min(
        ((at, s) for s in stop if s and (at := text.find(s)) >= 0),
        default=None,
        key=lambda found: found[0],
    )


def stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for s in stop:
        if len(s) > 1:
            tail = text[max(0, len(text) - (len(s) - 1)) :]
            longest = max(longest, _suffix_prefix_len(tail, s, longest))
    return longest


def _suffix_prefix_len(tail: str, s: str, floor: int) -> int:
    """The longest suffix of `tail` (shorter than `s`) that is a prefix of `s`, if longer
    than `floor`; else at most `floor`."""
    end = len(tail) - floor
    at = tail.find(s[0], 0, end) if end > 0 else -1
    for _ in range(CANDIDATES_BEFORE_KMP):
        if at < 0:
            return 0
        if tail.startswith(s[: len(tail) - at], at):
            return len(tail) - at
        at = tail.find(s[0], at + 1, end)
    return 0 if at < 0 else _kmp_suffix_prefix_len(tail, s)


def _kmp_suffix_prefix_len(tail: str, s: str) -> int:
    """KMP: after reading `tail`, `matched` is its longest suffix that is a prefix of `s`."""
    fail = _failure(s)
    matched = 0
    for char in tail:
        while matched and s[matched] != char:
            matched = fail[matched - 1]
        if s[matched] == char:
            matched += 1
    return matched


@functools.lru_cache(maxsize=1024)
def _failure(s: str) -> tuple[int, ...]:
    """KMP's table: fail[i] is the longest proper prefix of s[: i + 1] that is also its
    suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[k] != s[i]:
            k = fail[k - 1]
        if s[k] == s[i]:
            k += 1
        fail[i] = k
    return tuple(fail)


def stop_window_tokens(stop: list[str], base: int) -> int:
    """Tokens of context that span any held-back stop-string prefix: a token decodes to at
    least one byte, so a stop string's UTF-8 length bounds the tokens it can span."""
    return base + max((len(s.encode()) for s in stop), default=0)
