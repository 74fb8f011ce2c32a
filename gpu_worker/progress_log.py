"""The worker's side of its progress log (jobs/progress.py): what the next publish logs, and
how far the log may be trimmed.

Each publish logs, in its commit, one entry with every job's new output ids, the job named by
a slot number, and by its rid too in the first entry about it of this life (or the next, if
that one was not written). The log keeps what a job that must resume needs: every entry from
the first one about each job this life still holds, which names it. A job this life took
back with more ids than it carries (rebuilt from the log after a restart) logs those ids
again first, so the entries of the previous life can go.
After a restart or a failed step the jobs are admitted again from the log: until they are,
nothing is trimmed (`hold`).

A job that ended is marked so in the entry of its last publish (`end`: ProgressEntry's
``done``), and stays held until its acknowledgement is written, which may be a later commit
(bus/fenced_stream.py): until then a reader of the log must find the mark, and the entry
that names the job.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from jobs.progress import ProgressEntry
from jobs.wire import encode


def _id_order(entry_id: bytes) -> tuple[int, ...]:
    return tuple(int(part) for part in entry_id.split(b"-"))


class ProgressLog:
    def __init__(self, worker_id: str, trim_interval_s: float) -> None:
        self.worker_id = worker_id
        self.trim_interval_s = trim_interval_s
        self._segments: dict[str, tuple[int, list[int]]] = {}  # of the next entry: start, ids
        self._first_entry: dict[str, bytes] = {}  # of each job this life holds
        self._in_flight: list[str] = []  # rids of the entry being written, without a first
        self._slots: dict[str, int] = {}  # each held job's slot number (jobs/progress.py)
        self._done: dict[str, int | str] = {}  # of the next entry: the jobs that ended
        self._ended: set[str] = set()  # held until their acknowledgement is written
        self._next_slot = 0
        self._last_entry: bytes | None = None
        self._next_trim = 0.0
        self._trimmed_to: bytes | None = None
        self.holding = False

    def log(self, rid: str, start: int, ids: list[int]) -> None:
        """The job's output ids from `start` on go in the next entry. Ids already waiting
        there for the job are kept up to `start`: a job taken back logs its history again,
        and if it steps before the next publish its new ids must extend that history, not
        replace it (the log below the entry would be trimmed, and the history lost with it:
        the next restart would find a gap and generate the job's first tokens again)."""
        if not ids:
            return
        pending = self._segments.get(rid)
        if pending is not None and pending[0] <= start <= pending[0] + len(pending[1]):
            first, known = pending
            self._segments[rid] = (first, known[: start - first] + list(ids))
        else:
            self._segments[rid] = (start, list(ids))

    def take(self) -> bytes | None:
        """The next entry's payload (None: nothing to log); `written` says where it went."""
        if not self._segments and not self._done:
            return None
        self._in_flight = [rid for rid in self._segments if rid not in self._first_entry]
        named = set(self._in_flight)
        slots = [ProgressEntry.slot(self._slot_of(rid), start, ids, rid if rid in named else None)
                 for rid, (start, ids) in self._segments.items()]  # fmt: skip
        payload = encode(ProgressEntry(self.worker_id, slots=slots, done=[*self._done.values()]))
        self._segments, self._done = {}, {}
        return payload

    def end(self, rid: str) -> None:
        """The job ended: say so in the next entry, and hold it until `forget` (its
        acknowledgement is written)."""
        self._segments.pop(rid, None)
        named = rid in self._first_entry  # by a written entry, which stays while it is held
        self._done[rid] = self._slots[rid] if named else rid
        self._ended.add(rid)

    def _slot_of(self, rid: str) -> int:
        """The job's slot for this life: never given to another job of this life, so an
        entry that names it can be trimmed once the job is no longer held."""
        slot = self._slots.get(rid)
        if slot is None:
            slot = self._slots[rid] = self._next_slot
            self._next_slot += 1
        return slot

    def written(self, entry_id: bytes | None) -> None:
        """The entry `take` gave is on the log under `entry_id` (None: it was not written)."""
        if entry_id is not None:
            for rid in self._in_flight:
                self._first_entry.setdefault(rid, entry_id)
            self._last_entry = entry_id
        self._in_flight = []

    def forget(self, rid: str) -> None:
        """The job ended here, or went elsewhere: the log need not keep it."""
        self._first_entry.pop(rid, None)
        self._segments.pop(rid, None)
        self._slots.pop(rid, None)
        self._ended.discard(rid)

    def hold(self) -> None:
        """Every job is dropped, to be admitted again from the log: keep it all until then
        (those that ended only wait for their acknowledgement: they stay as they are)."""
        self._segments.clear()
        for rid in list(self._done):  # ends not yet written: those jobs run again
            self.forget(rid)
        self._done.clear()
        self._first_entry = {rid: e for rid, e in self._first_entry.items() if rid in self._ended}
        self.holding = True

    def trim_point(self, acked: Collection[str] = ()) -> bytes | None:
        """The id below which the log may go (XTRIM MINID), at most once per trim interval,
        and at once when the last job this life holds ended (an idle worker publishes no
        more, so its log would keep them until its next job). `acked`: jobs that ended whose
        acknowledgements the commit that trims writes, which need not be held then."""
        now = time.monotonic()
        if self.holding or self._last_entry is None:
            return None
        held = self._first_entry  # a copy only when the worker ran dry (`acked`): rarely
        if acked:
            held = {rid: entry for rid, entry in held.items() if rid not in acked}
        idle = not held and self._trimmed_to != self._last_entry
        if now < self._next_trim and not idle:
            return None
        self._next_trim = now + self.trim_interval_s
        point = min(held.values(), key=_id_order) if held else None
        self._trimmed_to = point or self._last_entry
        return self._trimmed_to
