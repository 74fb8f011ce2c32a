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


# ---- jobs named by slot -----------------------------------------------------------------------


def _taken(log: ProgressLog, entry_id: bytes | None) -> ProgressEntry:
    entry = decode(log.take(), ProgressEntry)
    log.written(entry_id)
    return entry


def test_a_job_is_named_by_its_rid_in_its_first_entry_and_by_its_slot_after():
    log = ProgressLog("w", trim_interval_s=0.0)
    log.log("rid-a", 0, [1, 2])
    first = _taken(log, b"1-0")
    log.log("rid-a", 2, [3])
    log.log("rid-b", 0, [7])
    second = _taken(log, b"2-0")
    assert first.slots == [ProgressEntry.slot(0, 0, [1, 2], "rid-a")]
    assert second.slots == [ProgressEntry.slot(0, 2, [3]), ProgressEntry.slot(1, 0, [7], "rid-b")]
    assert rebuild([first, second], {"rid-a": [], "rid-b": []}) == {
        "rid-a": [1, 2, 3], "rid-b": [7]
    }  # fmt: skip


def test_an_entry_that_was_not_written_leaves_the_next_one_to_name_its_jobs():
    log = ProgressLog("w", trim_interval_s=0.0)
    log.log("a", 0, [1])
    _taken(log, None)  # its MULTI failed
    log.log("a", 0, [1, 2])
    assert _taken(log, b"3-0").slots == [ProgressEntry.slot(0, 0, [1, 2], "a")]


def test_a_later_life_giving_the_same_slots_to_other_jobs_rebuilds_each_job():
    old_life, new_life = ProgressLog("w", 0.0), ProgressLog("w", 0.0)
    old_life.log("a", 0, [1, 2])
    entries = [_taken(old_life, b"1-0")]
    new_life.log("b", 0, [5])  # slot 0 again, now b's
    entries.append(_taken(new_life, b"2-0"))
    new_life.log("b", 1, [6])
    entries.append(_taken(new_life, b"3-0"))
    assert rebuild(entries, {"a": [], "b": []}) == {"a": [1, 2], "b": [5, 6]}


def test_a_slot_whose_naming_entry_is_gone_is_skipped_and_its_job_resumes_from_what_it_has():
    log = ProgressLog("w", 0.0)
    log.log("a", 0, [1])
    _taken(log, b"1-0")  # trimmed (or skipped as malformed)
    log.log("a", 1, [2])
    later = _taken(log, b"2-0")
    assert list(later.spans()) == []
    assert rebuild([later], {"a": [1]}) == {"a": [1]}


def test_a_log_of_segments_by_rid_then_slots_rebuilds_across_the_upgrade():
    older = _entry({"a": (0, [1, 2])})  # a worker before slots, then one after
    log = ProgressLog("w", 0.0)
    log.log("a", 2, [3])
    assert rebuild([older, _taken(log, b"2-0")], {"a": []}) == {"a": [1, 2, 3]}


@pytest.mark.parametrize(
    "span",
    [[0, 0], [-1, 0, b""], [True, 0, b""], [0, -2, b""], [0, 0, [1, 2]], [0, 0, b"", 5], "x",
     [0, 0, b"\0\0\0", "a"]],
)  # fmt: skip
def test_a_malformed_slot_is_a_protocol_error_and_rebuild_skips_its_entry(span):
    bad = ProgressEntry("w", slots=[span])
    with pytest.raises(ProtocolError):
        list(bad.spans())
    good = ProgressEntry("w", slots=[ProgressEntry.slot(0, 0, [1], "a")])
    assert rebuild([good, bad], {"a": []}) == {"a": [1]}
