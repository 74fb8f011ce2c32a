"""When a detokenizer replica last set each reply stream's expiry, so that a busy stream's is
renewed once a quarter of ``reply_ttl_s``, not with every batch.

A reply stream expires ``reply_ttl_s`` after its last renewal: its reader may be long gone.
Renewing it with every batch cost one EXPIRE per reply stream per publish, about one command
in twelve of a token's way through the bus. A bundled stream (the ingress's, a `Client`'s:
one per reader, named for its life) is renewed by this replica when it first writes it, and
then once a quarter TTL; between renewals the replica writes it only if it exists (XADD
NOMKSTREAM). So a stream its reader deleted stays deleted rather than come back without an
expiry, and a stream that expired (a whole TTL without a renewal by anyone) gets its expiry
back with the write that makes it again. A renewal counts only once the batch that carries it
is committed (`committed`): a turn Redis refused is handled again, and renews again. After an
outage (`forget`) every stream is written as new: Redis may be back empty, and a stream the
replica had written must be made again for its reader.
Streams of jobs that did not ask for bundles keep an EXPIRE per batch: a direct job's reader
may delete its stream and use the name again.
"""

from __future__ import annotations

# Past this many streams remembered, those due for renewal anyway are forgotten.
PRUNE_AT = 4096


class StreamExpiries:
    def __init__(self, ttl_s: int) -> None:
        self.interval_s = ttl_s / 4
        self._renewed: dict[str, float] = {}  # stream -> when a committed batch renewed it
        self._renewing: dict[str, float] = {}  # renewed by the batch being handled

    def begin(self) -> None:
        """A new batch: what an uncommitted one meant to renew did not happen."""
        self._renewing = {}

    def due(self, stream: str, now: float) -> bool:
        return now - self._renewed.get(stream, float("-inf")) >= self.interval_s

    def renewing(self, stream: str, now: float) -> None:
        self._renewing[stream] = now

    def forget(self) -> None:
        """Redis may have come back empty: no stream is known to exist any more."""
        self._renewed = {}
        self._renewing = {}

    def committed(self, now: float) -> None:
        self._renewed.update(self._renewing)
        self._renewing = {}
        if len(self._renewed) > PRUNE_AT:
            self._renewed = {s: t for s, t in self._renewed.items() if now - t < self.interval_s}
