"""A replayable stage's handled entries, acknowledged later with one of its reads.

The detokenizer's readers drop a delta they already have (by its ``seq``), so the detokenizer
may write a batch twice: it writes without a MULTI and acknowledges its inputs once the
writes have answered (a full Redis refuses an XADD, not an XACK: acknowledged beside a
refused write, a delta would be lost), in the round trip of a later XREADGROUP. Waiting a
tenth of ``claim_idle_ms`` (500 ms by default) before that acknowledgement folds the XACKs of
several publishes into one, and still comes long before a peer would claim the entries: a
replica that dies in between has them claimed and written again, which its readers ignore.
A read that finds the stream idle acknowledges at once.
"""

from __future__ import annotations

import time


class DeferredAcks:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.ids: list[bytes] = []
        self._due = 0.0  # when the oldest of `ids` has waited `wait_s`

    def add(self, entry_ids: list[bytes]) -> None:
        if entry_ids and not self.ids:
            self._due = time.monotonic() + self.wait_s
        self.ids.extend(entry_ids)

    def due(self) -> bool:
        return bool(self.ids) and time.monotonic() >= self._due

    def take(self) -> list[bytes]:
        ids, self.ids = self.ids, []
        return ids
