"""A stage's inputs besides its own stream: streams other processes write and own, read in
the same XREADGROUP and the same consumer group (bus/actor.py).

The detokenizers read the token batches in every worker's progress log
(bus/fenced_stream.py): a worker's publish is then one XADD, its log's, rather than that and
one to a shared tokens stream (issue 27). Which streams those are comes from the stage
(`source`: the detokenizer names the log of every registered worker), asked again every
``REFRESH_S``, and at once after a turn that read the stage's own stream (a worker that
opens its log says so there, so its first tokens do not wait) or a read found a stream gone.

A stream is joined with XGROUP CREATE and never made: the logs are their workers' fences, and
a log the reaper deleted must stay deleted (a worker taken for dead while alive would write
to one made again). A stream whose group is missing (an older worker's log) gets it, from
its first entry; one that does not exist yet is tried again at the next refresh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from bus.reconnect import REDIS_TRANSIENT

logger = logging.getLogger(__name__)

REFRESH_S = 5.0  # how stale the list may get: a new worker also announces itself


def _text(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


class ExtraInputs:
    """The extra inputs an Actor reads now, named by its stage's `source`."""

    def __init__(self, client: redis.Redis, group: str,
                 source: Callable[[redis.Redis], list[str]] | None) -> None:  # fmt: skip
        self.client = client
        self.group = group
        self.source = source
        self.streams: list[str] = []
        self._next_refresh = 0.0
        self._next_claim = 0  # round robin over the streams, one per claim

    def maybe_refresh(self, force: bool = False) -> None:
        """Ask the stage which streams to read, when due (or `force`d), and join new ones."""
        now = time.monotonic()
        if self.source is None or (now < self._next_refresh and not force):
            return
        self._next_refresh = now + REFRESH_S
        try:
            named = self.source(self.client)
        except REDIS_TRANSIENT:
            raise  # the Actor's reconnecting loop waits for Redis
        except Exception:  # what the stage read to name them: never the end of the stage
            logger.exception("could not name the extra inputs; reading the %d known",
                             len(self.streams))  # fmt: skip
            return
        known = set(self.streams)
        self.streams = [name for name in dict.fromkeys(named)
                        if name in known or self._join(name)]  # fmt: skip

    def lost(self) -> None:
        """A read named a stream that is gone: join every one again, now."""
        self.streams = []
        self.maybe_refresh(force=True)

    def next_to_claim(self) -> str | None:
        """The stream whose stale entries the next claim looks at (each in turn)."""
        if not self.streams:
            return None
        self._next_claim = (self._next_claim + 1) % len(self.streams)
        return self.streams[self._next_claim]

    def _join(self, stream: str) -> bool:
        try:
            self.client.xgroup_create(stream, self.group, id="0")  # never MKSTREAM
        except redis.ResponseError as exc:
            return str(exc).startswith("BUSYGROUP")  # else no such stream (yet)
        return True


def by_stream(response: object) -> list[tuple[str, list]]:
    """An XREADGROUP reply as (stream, entries) pairs, in RESP2's list or RESP3's map."""
    if not response:
        return []
    pairs = response.items() if isinstance(response, dict) else response
    return [(_text(stream), list(entries)) for stream, entries in pairs if entries]
