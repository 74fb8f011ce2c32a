"""N-gram (prompt lookup) drafting: propose the tokens that followed the last earlier place
where the request's latest n tokens appeared, in its prompt or its own output.

Copying from the context (quoting, editing code, summarising, structured output) is common,
and there a draft costs nothing to make: no model runs. Each request keeps an index from
every n-gram of its tokens to where it last ended, extended with the tokens appended since
the last lookup, so a lookup costs O(new tokens * max_n) instead of a scan of the sequence.
"""

from __future__ import annotations

# Longest and shortest n-gram matched: longer first, as a longer match predicts better. A
# one-token match is too often chance.
MAX_NGRAM = 4
MIN_NGRAM = 2


class NgramIndex:
    """Where each n-gram (MIN_NGRAM <= n <= MAX_NGRAM) of one token sequence last ended."""

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `ids`, which must extend the ids of earlier calls."""
        end = len(ids)
        # Index the n-grams ending before `end`; the one ending at `end` is what we look up,
        # and indexing it would only find itself.
        for stop in range(max(self._indexed, MIN_NGRAM), end):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, stop) + 1):
                self._ends[tuple(ids[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)
        for n in range(min(MAX_NGRAM, end), MIN_NGRAM - 1, -1):
            found = self._ends.get(tuple(ids[end - n :]))
            if found is not None:
                # A match close to the end runs into the tokens being continued: the text
                # repeats with that period, so the draft keeps repeating it.
                draft: list[int] = []
                for pos in range(found, found + k):
                    draft.append(ids[pos] if pos < end else draft[pos - end])
                return draft
        return []
