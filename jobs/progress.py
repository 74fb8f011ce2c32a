"""A worker's progress log: what it has published of each job, to resume the job elsewhere.

A worker writes one `ProgressEntry` to its own progress stream (``<p>:progress:<id>``) in the
commit that publishes a TokenBatch: for every job with new tokens, the output ids the batch
published (``[slot, start, packed ids]``, packed as jobs/wire.py's `pack_ids_narrow` does:
uint16 where they fit, else int32; a reader takes either). A job is named by its rid once,
in the first entry about it of the writer's life, and by a slot number after that
(`ProgressEntry` says why and how); readers read the log in order. That is one command per
publish for all its jobs, where a key per job cost an APPEND and an EXPIRE per job per step.
The log is read only when a job must resume: the reaper moving a dead worker's jobs, or a
worker taking back its own pending jobs after a restart. `rebuild` puts each job's ids back
together; the job then carries them in its ``progress`` field (jobs/requests.py's
TokenizedRequest) to whichever worker continues it.

A segment starts where the ids its job already carries end: a worker that resumes a job
first logs the ids it knows beyond the job's own ``progress``, so the log below its first
entry about a job may be trimmed (gpu_worker/progress_log.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from jobs import wire
from jobs.wire import Message, ProtocolError, pack_ids_narrow, unpack_ids

logger = logging.getLogger(__name__)


@dataclass
class ProgressEntry(Message):
    """The output ids one publish of `worker_id` carried, per job.

    ``slots``: per job, ``[slot, start, packed ids]``, the job named by a number its writer
    gave it for its life, and ``[slot, start, packed ids, rid]`` where the entry names it:
    the first entry about the job of that life (the log is never trimmed above it while the
    job is held) and any entry after one that was not written. A rid per job per publish was
    the largest part of these entries (~34 bytes to a few ids). ``segments`` (rid -> [start,
    packed ids]) is the form before slots, still read; an entry may hold both.

    ``done``: the jobs that ended with this publish, each by its slot, or by its rid where
    no entry named it yet. Their acknowledgements may follow in a later commit
    (bus/fenced_stream.py), so a job found pending whose log says it ended is acknowledged,
    not run again (`ended_jobs`)."""

    KIND = "progress"
    COMPRESSIBLE = True
    FIELDS = {"worker_id": wire.STR, "segments": wire.MAP, "v": wire.INT, "slots": wire.LIST,
              "done": wire.LIST}  # fmt: skip
    OPTIONAL = frozenset({"v", "segments", "slots", "done"})

    worker_id: str
    segments: dict[str, list[Any]] = field(default_factory=dict)
    v: int = wire.WIRE_VERSION
    slots: list[list[Any]] = field(default_factory=list)
    done: list[Any] = field(default_factory=list)

    @staticmethod
    def segment(start: int, ids: list[int]) -> list[Any]:
        return [start, pack_ids_narrow(ids)]

    @staticmethod
    def slot(slot: int, start: int, ids: list[int], rid: str | None = None) -> list[Any]:
        """A job's ids in ``slots``; `rid` where this entry names its slot."""
        span = [slot, start, pack_ids_narrow(ids)]
        return span if rid is None else [*span, rid]

    def spans(self, names: dict[int, str] | None = None) -> Iterable[tuple[str, int, list[int]]]:
        """(rid, start, ids) of each segment and slot; raises `ProtocolError` for a malformed
        one. `names`: the slots' rids named by the log's earlier entries, updated with this
        one's; a slot no entry read so far names is skipped (its naming entry was trimmed:
        a job no longer held, or skipped as malformed: the job resumes from what it has)."""
        for rid, segment in self.segments.items():
            if not isinstance(rid, str) or not isinstance(segment, list) or len(segment) != 2:
                raise ProtocolError(f"malformed progress segment for {rid!r}")
            yield rid, _start(segment[0], rid), _ids(segment[1], rid)
        names = {} if names is None else names
        for span in self.slots:
            if not isinstance(span, list) or len(span) not in (3, 4):
                raise ProtocolError("progress slot: must be [slot, start, ids] or "
                                    "[slot, start, ids, rid]")  # fmt: skip
            slot = span[0]
            if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
                raise ProtocolError(f"progress slot: {slot!r} is not a slot number")
            if len(span) == 4:
                if not isinstance(span[3], str):
                    raise ProtocolError(f"progress slot {slot}: its rid must be a string")
                names[slot] = span[3]
            rid = names.get(slot)
            start, ids = _start(span[1], slot), _ids(span[2], slot)
            if rid is not None:
                yield rid, start, ids

    def ended_rids(self, names: dict[int, str]) -> list[str]:
        """The rids of ``done``, slots resolved by `names` (as `spans` left them); raises
        `ProtocolError` for a malformed one. A slot no entry named is skipped (see `spans`)."""
        rids = []
        for job in self.done:
            if isinstance(job, str):
                rids.append(job)
            elif isinstance(job, int) and not isinstance(job, bool):
                if job in names:
                    rids.append(names[job])
            else:
                raise ProtocolError(f"progress done: {job!r} is neither a slot nor a rid")
        return rids


def _start(start: Any, job: str | int) -> int:
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ProtocolError(f"malformed progress segment for {job!r}: start {start!r}")
    return start


def _ids(packed: Any, job: str | int) -> list[int]:
    if not isinstance(packed, (bytes, msgpack.ExtType)):
        raise ProtocolError(f"malformed progress segment for {job!r}: ids not packed")
    return unpack_ids(packed)


def rebuild(
    entries: Iterable[ProgressEntry], known: dict[str, list[int]], rids: Iterable[str] | None = None
) -> dict[str, list[int]]:
    """Each job's published output ids: the ids it carried (`known`, by rid) extended by the
    log's segments in order. Only `rids` (default: those in `known`) are rebuilt.

    A segment that starts inside what is known replaces the rest (the same ids, logged
    again by a worker that resumed the job); one that starts past the end would leave a
    gap, so the job keeps what it has up to there: resuming early repeats no token a reader
    keeps (readers drop what they already have, by position).
    """
    wanted = set(known if rids is None else rids)
    ids = {rid: list(known.get(rid, ())) for rid in wanted}
    gaps: set[str] = set()
    for entry, spans, _ in _read(entries):
        for rid, start, new in spans:
            if rid not in ids or rid in gaps:
                continue
            have = ids[rid]
            if start > len(have):
                logger.warning("progress of %s: %s jumps from %d to %d; resuming at %d",
                               entry.worker_id, rid, len(have), start, len(have))  # fmt: skip
                gaps.add(rid)
                continue
            del have[start:]
            have += new
    return ids


def ended_jobs(entries: Iterable[ProgressEntry]) -> set[str]:
    """The rids of the jobs the log says ended (``done``)."""
    return {rid for _, _, done in _read(entries) for rid in done}


def _read(
    entries: Iterable[ProgressEntry],
) -> Iterator[tuple[ProgressEntry, list[tuple[str, int, list[int]]], list[str]]]:
    """Each entry with its spans and ended rids, its slots named by the entries before it; a
    malformed entry is skipped (logged)."""
    names: dict[int, str] = {}  # slot -> rid, as the entries read so far name them
    for entry in entries:
        try:
            spans = list(entry.spans(names))
            done = entry.ended_rids(names)
        except ProtocolError as exc:
            logger.warning("progress of %s: skipping an entry: %s", entry.worker_id, exc)
            continue
        yield entry, spans, done
