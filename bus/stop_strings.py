"""Stop-string matching, shared by the worker's TextStream and the detokenizer stage so both
cut a request's text at the same place.

Cost: callers pass only the text that can hold a new match (the held-back tail plus the new
text), never the whole output, so a step costs O(new text + longest stop) per stop string.
`stop_prefix_len` runs a KMP automaton over the last len(s) - 1 characters, linear in the
stop string's length where testing each prefix length with `endswith` was quadratic in it.
"""

from __future__ import annotations


def find_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text`, as (position, stop string); None if none."""
    return min(
        ((at, s) for s in stop if s and (at := text.find(s)) >= 0),
        default=None,
        key=lambda found: found[0],
    )


def stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    return max((_suffix_prefix_len(text, s) for s in stop if s), default=0)


def _suffix_prefix_len(text: str, s: str) -> int:
    """The longest suffix of `text` that is a proper prefix of `s`: KMP over the only part
    of `text` such a suffix can lie in, its last len(s) - 1 characters."""
    fail = _failure(s)
    matched = 0
    for char in text[max(0, len(text) - (len(s) - 1)) :] if len(s) > 1 else "":
        while matched and s[matched] != char:
            matched = fail[matched - 1]
        if s[matched] == char:
            matched += 1
    return matched


def _failure(s: str) -> list[int]:
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
    return fail


def stop_window_tokens(stop: list[str], base: int) -> int:
    """Tokens of context that span any held-back stop-string prefix: a token decodes to at
    least one byte, so a stop string's UTF-8 length bounds the tokens it can span."""
    return base + max((len(s.encode()) for s in stop), default=0)
