"""A worker's progress log: what it has published of each job, to resume the job elsewhere.

A worker writes one `ProgressEntry` to its own progress stream (``<p>:progress:<id>``) in the
MULTI that publishes a TokenBatch: for every job with new tokens, the output ids the batch
published (``rid -> [start, packed ids]``, packed as jobs/wire.py's `pack_ids_narrow` does:
uint16 where they fit, else int32; a reader takes either). That is one command per publish for
all its jobs, where a key per job cost an APPEND and an EXPIRE per job per step. The log is
read only when a job must resume: the reaper moving a dead worker's jobs, or a worker taking
back its own pending jobs after a restart. `rebuild` puts each job's ids back together; the
job then carries them in its ``progress`` field (jobs/requests.py's TokenizedRequest) to
whichever worker continues it.

A segment starts where the ids its job already carries end: a worker that resumes a job
first logs the ids it knows beyond the job's own ``progress``, so the log below its first
entry about a job may be trimmed (gpu_worker/progress_log.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from jobs.wire import (
    INT,
    MAP,
    STR,
    WIRE_VERSION,
    Message,
    ProtocolError,
    pack_ids_narrow,
    unpack_ids,
)

logger = logging.getLogger(__name__)


@dataclass
class ProgressEntry(Message):
    """The output ids one publish of `worker_id` carried, per job: rid -> [start, packed ids]."""

    KIND = "progress"
    COMPRESSIBLE = True
    FIELDS = {"worker_id": STR, "segments": MAP, "v": INT}
    OPTIONAL = frozenset({"v"})

    worker_id: str
    segments: dict[str, list[Any]]
    v: int = WIRE_VERSION

    @staticmethod
    def segment(start: int, ids: list[int]) -> list[Any]:
        return [start, pack_ids_narrow(ids)]

    def spans(self) -> Iterable[tuple[str, int, list[int]]]:
        """(rid, start, ids) of each segment; raises `ProtocolError` for a malformed one."""
        for rid, segment in self.segments.items():
            if (
                not isinstance(rid, str)
                or not isinstance(segment, list)
                or len(segment) != 2
                or not isinstance(segment[0], int)
                or isinstance(segment[0], bool)
                or segment[0] < 0
                or not isinstance(segment[1], (bytes, msgpack.ExtType))
            ):
                raise ProtocolError(f"malformed progress segment for {rid!r}")
            yield rid, segment[0], unpack_ids(segment[1])


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
    for entry in entries:
        try:
            spans = list(entry.spans())
        except ProtocolError as exc:
            logger.warning("progress of %s: skipping an entry: %s", entry.worker_id, exc)
            continue
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
