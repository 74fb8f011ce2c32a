"""What a worker's prefix cache gained and lost: `KvEvents`, on the per-shard stream
``<p>:kv-events`` (BusConfig.kv_events_stream), read by every router replica.

Blocks are named by their chained hashes (jobs/kv_blocks.py). One entry per worker publish
that changed something, written in the worker's publishing commit (bus/fenced_stream.py): the
hashes of the blocks stored and removed since the previous one. An entry with ``snapshot``
set replaces everything a reader knew of the worker by ``stored`` (``removed`` is then
empty): a worker writes one when it starts (an empty one: a new life holds nothing), when it
flushes its cache, and every ``kv_snapshot_interval_s`` while it publishes, so a reader that
starts after the stream was trimmed (it is capped at ``kv_events_maxlen`` entries) converges.

An entry may also carry the worker's load when it was written (`LoadReading`: the figures
its heartbeat announces, with the worker's wall ``time``). A finishing job inserts into the
cache, so an entry follows nearly every finish, and the worker writes one with no blocks
when a job finished but the cache did not change (gpu_worker/publishing.py): the router
learns that a worker is a job lighter at once, not at its next heartbeat, at no command of
its own. The router uses, per
worker, whichever of the two figures is newer by ``time`` (stages/router/stage.py). Entries
of workers from before the load was added leave it out; a load with a field missing or
negative makes the entry malformed, as a bad block hash does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.kv_blocks import MAX_HASH
from jobs.wire import BOOL, FLOAT, INT, LIST, STR, Message, ProtocolError

LOAD_FIELDS = ("running", "waiting", "free_kv_tokens", "admitted", "time")


@dataclass(frozen=True)
class LoadReading:
    """A worker's load as it stood at `time` (its wall clock, as Heartbeat.time)."""

    running: int
    waiting: int
    free_kv_tokens: int
    admitted: int  # jobs read from its stream since it started
    time: float


def _check_hashes(name: str, values: list[Any]) -> None:
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_HASH:
            raise ProtocolError(f"field {name!r} must hold unsigned 64-bit block hashes",
                                field=name)  # fmt: skip


def _check_load(events: KvEvents) -> None:
    """All of the load's fields or none, none negative."""
    present = [name for name in LOAD_FIELDS if getattr(events, name) is not None]
    if present and len(present) < len(LOAD_FIELDS):
        missing = next(name for name in LOAD_FIELDS if name not in present)
        raise ProtocolError(f"field {missing!r} is missing from the load", field=missing)
    for name in present:
        if getattr(events, name) < 0:
            raise ProtocolError(f"field {name!r} must not be negative", field=name)


@dataclass
class KvEvents(Message):
    """Blocks `worker_id`'s cache stored and removed since its previous entry (or, with
    `snapshot`, all it holds), and optionally its load when it wrote them."""

    KIND = "kv"
    FIELDS = {
        "worker_id": STR, "stored": LIST, "removed": LIST, "snapshot": BOOL,
        "running": INT, "waiting": INT, "free_kv_tokens": INT, "admitted": INT, "time": FLOAT,
    }  # fmt: skip
    OPTIONAL = frozenset(FIELDS) - {"worker_id"}

    worker_id: str
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    snapshot: bool = False
    # The load (`LoadReading`), all five or none: workers from before it was added write none.
    running: int | None = None
    waiting: int | None = None
    free_kv_tokens: int | None = None
    admitted: int | None = None
    time: float | None = None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> KvEvents:
        events = super().from_wire(data)
        _check_hashes("stored", events.stored)
        _check_hashes("removed", events.removed)
        _check_load(events)
        return events

    @property
    def load(self) -> LoadReading | None:
        """The worker's load when it wrote the entry; None when the entry has none."""
        if self.time is None:
            return None
        return LoadReading(self.running, self.waiting, self.free_kv_tokens, self.admitted,
                           self.time)  # fmt: skip
