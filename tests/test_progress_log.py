"""A worker's progress log: one entry per publish for all its jobs, rebuilt into each job's
published ids when a job must resume, and trimmed below the oldest job it still holds."""

from __future__ import annotations

import pytest

from gpu_worker.progress_log import ProgressLog
from jobs.progress import ProgressEntry, rebuild
from jobs.protocol import ProtocolError, decode, pack_ids


def _entry(segments: dict[str, tuple[int, list[int]]]) -> ProgressEntry:
    return ProgressEntry(
        "w", {rid: [start, pack_ids(ids)] for rid, (start, ids) in segments.items()}
    )


def test_rebuild_joins_each_jobs_segments_after_what_it_carries():
    log = [
        _entry({"a": (0, [1, 2]), "b": (3, [9])}),
        _entry({"a": (2, [3]), "b": (4, [8, 7])}),
        _entry({"c": (0, [5])}),
    ]
    assert rebuild(log, {"a": [], "b": [4, 4, 4]}) == {"a": [1, 2, 3], "b": [4, 4, 4, 9, 8, 7]}
    assert rebuild(log, {"a": []}, ["a", "c"]) == {"a": [1, 2, 3], "c": [5]}


def test_rebuild_takes_a_job_logged_again_from_its_start_and_stops_at_a_gap():
    log = [_entry({"a": (0, [1, 2, 3])}), _entry({"a": (1, [2, 3, 4])}), _entry({"b": (2, [6])})]
    assert rebuild(log, {"a": [], "b": []}) == {"a": [1, 2, 3, 4], "b": []}


def test_rebuild_skips_a_malformed_entry():
    bad = ProgressEntry("w", {"a": ["x", b"\0\0\0\0"]})
    with pytest.raises(ProtocolError):
        list(bad.spans())
    assert rebuild([_entry({"a": (0, [1])}), bad, _entry({"a": (1, [2])})], {"a": []}) == {
        "a": [1, 2]
    }


def test_the_log_writes_one_entry_per_publish_and_trims_below_the_oldest_job():
    log = ProgressLog("w", trim_interval_s=0.0)
    assert log.take() is None and log.trim_point() is None  # nothing logged yet
    log.log("a", 0, [1, 2])
    log.log("b", 0, [])  # nothing new: not in the entry
    entry = decode(log.take(), ProgressEntry)
    assert list(entry.spans()) == [("a", 0, [1, 2])]
    log.written(b"1-0")
    log.log("a", 2, [3])
    log.log("b", 0, [7])
    log.take()
    log.written(b"2-0")
    assert log.trim_point() == b"1-0"  # "a" began in 1-0
    log.forget("a")
    assert log.trim_point() == b"2-0"
    log.forget("b")
    assert log.trim_point() == b"2-0"  # nothing held: all but the last entry may go


def test_the_log_is_not_trimmed_while_jobs_wait_to_be_admitted_again_from_it():
    log = ProgressLog("w", trim_interval_s=0.0)
    log.log("a", 0, [1])
    log.take()
    log.written(b"5-0")
    log.hold()
    assert log.trim_point() is None
    log.holding = False
    assert log.trim_point() == b"5-0"


def test_trims_wait_for_the_interval_while_jobs_run():
    log = ProgressLog("w", trim_interval_s=60.0)
    log.log("a", 0, [1])
    log.take()
    log.written(b"1-0")
    assert log.trim_point() == b"1-0"
    assert log.trim_point() is None  # within the interval
    log.log("a", 1, [2])
    log.take()
    log.written(b"2-0")
    assert log.trim_point() is None  # "a" still runs: within the interval
    log.forget("a")
    assert log.trim_point() == b"2-0"  # the last job ended: at once (the worker may go idle)
    assert log.trim_point() is None  # and once


def test_a_job_logged_again_keeps_its_history_when_it_steps_before_the_next_publish():
    # A job taken back logs its history again (from 0); if it steps before that reaches the
    # log, its new ids join the history in one segment: the entry alone rebuilds the job,
    # so trimming below it loses nothing (a replaced history left a gap, and the next
    # restart generated the job's first tokens again).
    log = ProgressLog("w", trim_interval_s=0.0)
    log.log("a", 0, [1, 2])
    log.log("a", 2, [3])
    log.log("b", 0, [7, 8])
    log.log("b", 1, [9])  # from inside what waits: the rest is replaced
    entry = decode(log.take(), ProgressEntry)
    assert rebuild([entry], {"a": [], "b": []}) == {"a": [1, 2, 3], "b": [7, 9]}
    log.log("c", 0, [4])
    log.log("c", 3, [6])  # past what waits: a gap, so this segment stands alone
    assert list(decode(log.take(), ProgressEntry).spans()) == [("c", 3, [6])]
