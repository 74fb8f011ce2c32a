"""Stop-string matching, shared by the worker's TextStream and the detokenizer stage so both
cut a request's text at the same place."""

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
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def stop_window_tokens(stop: list[str], base: int) -> int:
    """Tokens of context that span any held-back stop-string prefix: a token decodes to at
    least one byte, so a stop string's UTF-8 length bounds the tokens it can span."""
    return base + max((len(s.encode()) for s in stop), default=0)
