"""What a worker's prefix cache gained and lost: `KvEvents`, on the per-shard stream
``<p>:kv-events`` (BusConfig.kv_events_stream), read by every router replica.

Blocks are named by their chained hashes (jobs/kv_blocks.py). One entry per worker publish
that changed something, written in the worker's publishing commit (bus/fenced_stream.py): the
hashes of the blocks stored and removed since the previous one. An entry with ``snapshot``
set replaces everything a reader knew of the worker by ``stored`` (``removed`` is then
empty): a worker writes one when it starts (an empty one: a new life holds nothing), when it
flushes its cache, and every ``kv_snapshot_interval_s`` while it publishes, so a reader that
starts after the stream was trimmed (it is capped at ``kv_events_maxlen`` entries) converges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.kv_blocks import MAX_HASH
from jobs.wire import BOOL, LIST, STR, Message, ProtocolError


def _check_hashes(name: str, values: list[Any]) -> None:
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_HASH:
            raise ProtocolError(f"field {name!r} must hold unsigned 64-bit block hashes",
                                field=name)  # fmt: skip


@dataclass
class KvEvents(Message):
    """Blocks `worker_id`'s cache stored and removed since its previous entry (or, with
    `snapshot`, all it holds)."""

    KIND = "kv"
    FIELDS = {"worker_id": STR, "stored": LIST, "removed": LIST, "snapshot": BOOL}
    OPTIONAL = frozenset({"stored", "removed", "snapshot"})

    worker_id: str
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    snapshot: bool = False

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> KvEvents:
        events = super().from_wire(data)
        _check_hashes("stored", events.stored)
        _check_hashes("removed", events.removed)
        return events
