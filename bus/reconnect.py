"""One reconnect policy for every loop on a consumer group.

A consumer outlives Redis outages: a turn that fails with a connection error or a timeout
is tried again after a backoff (``RECONNECT_BACKOFF_S``, the last step repeated), and
whatever the turn had not yet written stays with its owner for the next try. A Redis that
restarted without persistence has no groups: the group is made again after an outage, and
at once when a command says it is gone (NOGROUP); when that repeats with no turn done in
between, the group a command misses is not one this loop makes, and each try waits as a
reconnect does rather than spin a core and flood the log. A Redis at ``maxmemory`` (it runs
with ``noeviction``) refuses writes with OOM until memory is freed: that is an outage too,
retried the same way, so a turn whose MULTI was refused leaves its inputs pending rather
than acknowledging them. Any other error ends the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

logger = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
REDIS_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.OutOfMemoryError)


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create the group (and stream) if missing; replicas race here, so BUSYGROUP is fine."""
    try:
        # From id 0: jobs written before any consumer existed are still served.
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.OutOfMemoryError:
        # A full Redis refuses XGROUP CREATE before it could answer BUSYGROUP. A group that
        # exists is all a consumer needs to go on: reading, acknowledging and trimming are
        # allowed while full, and trimming is how memory comes back.
        if not _has_group(client, stream, group):
            raise
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _has_group(client: redis.Redis, stream: str, group: str) -> bool:
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return False  # no stream
    names = {g["name"].decode() if isinstance(g["name"], bytes) else g["name"] for g in groups}
    return group in names


def is_missing_group(exc: redis.ResponseError) -> bool:
    # redis-py prefixes an error raised from a MULTI with the failing command.
    message = str(exc)
    return message.startswith("NOGROUP") or "caused error: NOGROUP" in message


class ReconnectingLoop:
    """Runs a consumer's turns until `stop` is set, through outages and Redis restarts.

    `who` prefixes the log lines; `make_group` (re)creates the consumer's group; `on_retry`
    runs after each backoff wait (the worker reports its load, so its heartbeat goes on).
    """

    def __init__(
        self,
        who: str,
        stop: threading.Event,
        make_group: Callable[[], None],
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        self.who = who
        self.stop = stop
        self.make_group = make_group
        self.on_retry = on_retry

    def run(self, turn: Callable[[], object], *, group_made: bool = False) -> None:
        """Call `turn` until `stop` is set; the group is made before the first turn unless
        `group_made` says the caller has made it."""
        failures = regroups = 0
        first = not group_made
        while not self.stop.is_set():
            try:
                if failures or first:  # back after an outage: a restarted Redis has no groups
                    self.make_group()
                    first = False
                turn()
                failures = regroups = 0
            except REDIS_TRANSIENT as exc:
                delay = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
                failures += 1
                logger.warning("%s: Redis unavailable (%s); retrying in %.1f s",
                               self.who, exc, delay)  # fmt: skip
                self.stop.wait(delay)
                if self.on_retry is not None:
                    self.on_retry()
            except redis.ResponseError as exc:
                if not is_missing_group(exc):
                    raise
                logger.warning("%s: consumer group gone (Redis restarted?); recreating it",
                               self.who)  # fmt: skip
                if regroups:  # made and missing again at once: a group it does not make
                    self.stop.wait(RECONNECT_BACKOFF_S[min(regroups, len(RECONNECT_BACKOFF_S)) - 1])
                regroups += 1
                self.make_group()
