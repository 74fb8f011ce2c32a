"""How a worker's jobs end on the bus: each end marked on its progress log, and each entry of
its stream acknowledged once every job in it has ended.

A router sends a worker that reads bundles one entry per batch holding all of the batch's
jobs for it (stages/router/stage.py, jobs/wire.py): one XADD per batch, not one per job. Such
an entry stays pending until its last job ends, so a job's end can no longer be its entry's
acknowledgement. It is a mark on the progress log instead, in the entry of the job's last
publish (jobs/progress.py ``done``): whoever reads the log of a worker that died holding the
entry (stages/router/worker_reaper.py), or of its own previous life (gpu_worker/publishing.py
`progress`), acknowledges the jobs that ended and runs only the others. The log keeps a job
that ended, and the entry that names it, until the acknowledgement is written
(gpu_worker/progress_log.py). The acknowledgement itself may wait for a later commit
(bus/fenced_stream.py `ack_later`), so most of a busy worker's commits are one XADD.

Every way a job ends goes through `ended`: finished, refused, set aside, aborted on arrival,
or found ended on the log. A job never read (a malformed bundle, an entry deleted while
pending) has no rid to mark: its entry is acknowledged whole. A job with a malformed payload
inside a good bundle has none either; were the worker to die before the bundle's
acknowledgement, its dead letter would be written again.
"""

from __future__ import annotations

from bus.fenced_stream import FencedStream
from gpu_worker.progress_log import ProgressLog


class JobEnds:
    def __init__(self, bus: FencedStream, log: ProgressLog) -> None:
        self.bus = bus
        self.log = log
        self._left: dict[bytes, int] = {}  # entry -> its jobs not yet ended, past the first
        self._ended: dict[bytes, list[str]] = {}  # entry -> its ended jobs, until its ack

    def admitted(self, entry_id: bytes, jobs: int) -> None:
        """An entry holding `jobs` jobs was read (a plain entry holds one)."""
        if jobs > 1:
            self._left[entry_id] = jobs

    def ended(self, entry_id: bytes, rid: str | None) -> None:
        """Job `rid` of the entry ended here (None: a job with no rid to mark, or one that
        must not be marked: a duplicate of a job still running)."""
        if rid is not None:
            self.log.end(rid)
            self._ended.setdefault(entry_id, []).append(rid)
        left = self._left.pop(entry_id, 1) - 1
        if left > 0:
            self._left[entry_id] = left
        else:
            self.bus.ack_later(entry_id)

    def acked_with(self, acking: bool) -> set[str]:
        """The jobs whose entries' acknowledgements the next commit writes, if it writes all
        that are queued (`acking`; else it may not: none)."""
        if not acking:
            return set()
        return {rid for entry_id in self.bus.ended for rid in self._ended.get(entry_id, ())}

    def committed(self, written: bool) -> None:
        """After a commit: the jobs whose entries it acknowledged leave the log's hold. Fenced
        (not written): every job is dropped, and whoever admits them again reads their ends
        on the log."""
        if written:
            for entry_id in self.bus.acked_ended:
                for rid in self._ended.pop(entry_id, ()):
                    self.log.forget(rid)
            return
        for rids in self._ended.values():
            for rid in rids:
                self.log.forget(rid)
        self._ended.clear()
        self._left.clear()

    def dropped(self) -> None:
        """A step failed: every entry not yet acknowledged is read and admitted again (its
        jobs that ended are found so on the log, and end again), so start counting afresh.
        The entries whose acknowledgement is queued stay as they are."""
        waiting = set(self.bus.ended)
        for entry_id in [e for e in self._ended if e not in waiting]:
            for rid in self._ended.pop(entry_id):
                self.log.forget(rid)
        self._left.clear()
