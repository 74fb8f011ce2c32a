"""A replayable stage's handled entries, acknowledged later with one of its reads.

The detokenizer's readers drop a delta they already have (by its ``seq``), so the detokenizer
may write a batch twice: it writes without a MULTI and acknowledges its inputs once the
writes have answered (a full Redis refuses an XADD, not an XACK: acknowledged beside a
refused write, a delta would be lost), in the round trip of a later XREADGROUP. Waiting a
tenth of ``claim_idle_ms`` (500 ms by default) before that acknowledgement folds the XACKs of
several publishes into one, and still comes long before a peer would claim the entries: a
replica that dies in between has them claimed and written again, which its readers ignore.
They go at once when a read finds the stream idle, and when the stage says its last batch
settled everything (the detokenizer: every item of it a request's last), so a stream whose
traffic stopped shows nothing pending.
"""

from __future__ import annotations

import logging
import time

import redis

from bus.reconnect import REDIS_TRANSIENT

logger = logging.getLogger(__name__)


class DeferredAcks:
    def __init__(self, client: redis.Redis, stream: str, group: str, wait_s: float) -> None:
        self.client = client
        self.stream = stream
        self.group = group
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

    def flush(self) -> None:
        """Acknowledge them now, in a command of their own."""
        if self.ids:
            self.client.xack(self.stream, self.group, *self.ids)
            self.ids = []

    def flush_on_exit(self) -> None:
        try:
            self.flush()
        except (*REDIS_TRANSIENT, redis.ResponseError) as exc:  # left pending: claimed later
            logger.warning("%s: could not acknowledge %d handled entries on exit: %s",
                           self.group, len(self.ids), exc)  # fmt: skip
