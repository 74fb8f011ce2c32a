"""ForwardMode: what kind of step a forward is. A module of its own, without torch, so that
what only names step kinds (the worker's metrics, the synthetic engine) imports no torch."""

from __future__ import annotations

from enum import IntEnum


class ForwardMode(IntEnum):
    # Some request computes more than one new token (prefill, a prefill chunk, or a
    # retracted request being recomputed). Requests with one new token may ride along.
    EXTEND = 1
    # Every request computes exactly one new token.
    DECODE = 2
    # Speculative decoding: each request computes its last token and the tokens drafted
    # after it, attending like an extend; logits come back for every new token.
    TARGET_VERIFY = 4

    def is_extend(self) -> bool:
        """Attention runs the extend path: new tokens attend to a prefix and each other."""
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)
