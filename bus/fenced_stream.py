"""A worker's own stream, written to only under its fence (the reaper's side: bus/fence_off.py).

A worker reads jobs from its stream ``<p>:worker:<id>`` in the consumer group ``worker``
(`WORKER_GROUP`), where the router stage routes them. What a worker writes (its outputs, the
acknowledgements of its jobs, dead letters, an entry of its progress log) waits in the
buffers of its `FencedStream` until the next `commit`, one atomic script call
(bus/scripted_multi.py), or the log entry's XADD alone when that is all it writes (most
commits of a busy worker: `ack_later`): while there is work the bus costs one round trip per
publish (gpu_worker/worker.py publishes at most every ``publish_interval_ms``). New jobs are
read blocking (`read_blocking`), by a thread of the worker's own (gpu_worker/job_intake.py);
a commit can carry a non-blocking read instead, for a worker driven turn by turn.

A worker publishes its tokens in its progress log ``<p>:progress:<id>``: the commit's log
entry holds its TokenBatch (field ``t``) beside the progress (``m``, jobs/progress.py), and
the detokenizers read the batches there, in their group ``detokenizer`` (`LOG_READERS_GROUP`,
made with the log; bus/extra_inputs.py). The entry is written anyway (it is the fence,
below), so a publish costs one XADD, not two (issue 27). The worker trims its log below
the oldest job it holds and never below what the detokenizers have not acknowledged.

Nothing is lost when a worker dies. A job stays pending on the worker's stream until it
finishes, and the commit that publishes tokens also logs them, for all the worker's jobs at
once, in that entry; the entry with a job's last tokens also marks it ended
(jobs/progress.py ``done``), and its acknowledgement may follow in a later commit
(`ack_later`). When the heartbeat lapses, the router's reaper
(stages/router/worker_reaper.py) moves the pending jobs that had not ended to the router
again, each carrying the ids the log holds for it, and the worker that gets one continues
after them: no token is repeated or missing. A worker stopped with SIGTERM publishes what it
generated and leaves its jobs to the reaper the same way. A worker started again under the
same id takes back the entries its previous life left pending (`open`) and reads their
progress from its own log (bus/fence_off.py); each of those was handed to a worker that died
holding it, which `previous_deliveries` counts for the job's quarantine
(jobs/job_failures.py).

A worker taken for dead while alive (paused, or out of reach of Redis for longer than the
heartbeat TTL) must not go on publishing for jobs now served elsewhere: two writers would
send a client two versions of a token and garble the progress log. Its progress log is its
fence. Every commit writes an entry there first, in the same script call
(bus/scripted_multi.py, ``guarded``; an empty entry when no job has new ids), with
NOMKSTREAM; the reaper closes the log in the MULTI that claims jobs off the worker
(bus/fence_off.py: XSETID to the last possible id, so no XADD can add to it) and deletes it
once the worker is gone (moving to the tokens stream first the batches in it that the
detokenizers have not acknowledged: stages/router/worker_reaper.py). A commit whose entry
the log refuses, closed or missing, writes nothing and raises `Fenced` (a commit of the
entry alone is that XADD, and no script); the worker drops every job and starts again from
`restart_fenced`, which opens its log again: the entries still pending to it are its own,
and resume from the log. The fence so costs no command of its own: a GET of a fence key in
every commit had been one command per publish, a quarter of a batch-1 decode step's (issue
27). A Redis restarted empty has no log either: its worker's first commit is fenced, and it
serves on with what is pending to it (nothing: the jobs were lost with Redis). The reaper
also changes the fence key that workers before this fence read (`legacy_fence_key`), so
routers are upgraded before workers.

The worker trims its stream, at most once per ``trim_interval_s``, below what its group has
acknowledged (bus/stream_trim.py): a job stays on the stream until it finishes. It trims its
progress log below the first entry about the oldest job it holds
(gpu_worker/progress_log.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from bus.aborts import aborted_rids, aborts_stream
from bus.actor import unique_consumer_name
from bus.effects import (
    Outbound,
    Output,
    execute_logging_errors,
    write_dead_letters,
    write_outputs,
)
from bus.reconnect import ensure_group
from bus.scripted_multi import ScriptedMulti
from bus.stream_trim import StreamTrimmer, parse_id, trim_floor
from jobs.progress import ProgressEntry
from jobs.protocol import ENTRY_FIELD, TOKENS_FIELD, TokenBatch, encode
from runtime.config import BusConfig

logger = logging.getLogger(__name__)

WORKER_GROUP = "worker"  # the workers' consumer group, one per worker stream
# The consumer group on every worker's progress log that reads the token batches in it: the
# detokenizers (stages/detokenizer/stage.py names its group with this).
LOG_READERS_GROUP = "detokenizer"

Entry = tuple[bytes, dict[bytes, bytes] | None]  # (entry id, fields; None once trimmed)

ABORTS_READ = 1_000  # aborts entries one commit reads at most: a worker behind catches up
# How long, and how many, the acknowledgements of ended jobs may wait (`ack_later`).
ENDED_ACK_WAIT_S = 1.0
ENDED_ACKS_MAX = 1_000

# A log whose last id is this takes no more entries (XADD fails): the reaper's fence.
CLOSED_LOG_ID = "18446744073709551615-18446744073709551615"

# A worker opening its log: made if missing, opened again if a reaper closed it (its last
# id set back to its newest entry's, or, emptied, to the last deleted one's), then an entry
# (ARGV[1], ARGV[2]: its field and payload) added, which a closed log (ARGV[3] the closed
# id) would refuse, and the readers' group made if missing (a log made by an older worker
# has none), and an empty token batch put on the tokens stream, which wakes the detokenizers
# to read the log from now on (bus/extra_inputs.py). One call, so no reaper closes it
# between the look and the reopening.
OPEN_LOG = """#!lua
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  local fields = {}
  for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
  if fields['last-generated-id'] == ARGV[3] then
    local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
    redis.call('XSETID', KEYS[1], newest and newest[1] or fields['max-deleted-entry-id'])
  end
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
-- The detokenizers' group (ARGV[4]) from the log's first entry: they read every token batch;
-- and a word to them on the tokens stream (KEYS[2], an empty batch ARGV[5]): read this log.
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[4], '0')
redis.call('XADD', KEYS[2], '*', ARGV[1], ARGV[5])
return id
"""


class Fenced(Exception):  # noqa: N818 (a state the worker recovers from, not an error)
    """The reaper claimed jobs off this worker since its last commit: nothing was written."""


class FencedStream:
    """One worker's consumer on its stream, with the buffers of its next commit."""

    def __init__(self, client: redis.Redis, config: BusConfig, worker_id: str) -> None:
        self.client = client
        self.config = config
        self.who = f"worker {worker_id}"
        self.worker_id = worker_id
        self.stream = config.worker_stream(worker_id)
        self.consumer = unique_consumer_name(f"worker-{worker_id}")
        # Written by the next commit, all or nothing:
        self.outbox: list[Output] = []
        self.acks: list[bytes] = []
        # Acknowledgements that may wait (`ack_later`): the log already says their jobs ended.
        self.ended: list[bytes] = []
        self.ack_ended = False  # acknowledge `ended` in the next commit, due or not
        self.acked_ended: list[bytes] = []  # the part of `ended` the last commit acknowledged
        self._ended_since = 0.0
        self.dead: list[dict[str, Any]] = []  # dead_letter_fields
        self.progress_stream = config.progress_stream(worker_id)  # also our fence
        self._no_progress = encode(ProgressEntry(worker_id))  # a commit's entry, no job in it
        self._open_log = client.register_script(OPEN_LOG)
        self._log_opened = False
        self.progress: bytes | None = None  # an encoded ProgressEntry, for the log
        self.progress_trim: bytes | None = None  # trim the log below this id (MINID)
        self.progress_written: bytes | None = None  # where the last commit logged `progress`
        self.kv_events: bytes | None = None  # an encoded KvEvents, for the kv-events stream
        self.abort_checks: list[str] = []  # rids the commit looks for on the aborts stream
        self.flagged: list[str] = []  # of those, the ones the last commit found aborted
        self.aborts_stream = aborts_stream(config)
        self.aborts_seen: bytes | str = "0-0"  # the last aborts entry read (`open` moves it)
        # Entry id -> deliveries to a previous life under this id, for the entries `open`
        # took back (read once, when the job is admitted).
        self.previous_deliveries: dict[bytes, int] = {}
        self.trimmer = StreamTrimmer(client, self.stream, config.trim_interval_s)

    def ensure_group(self) -> None:
        ensure_group(self.client, self.stream, WORKER_GROUP)

    def open(self) -> list[Entry]:
        """Make the group, open our progress log (our fence), and return the entries a
        previous life under this id left pending: they are ours, to resume from their
        progress."""
        self.ensure_group()
        self.open_log()
        # Aborts from now on (those of jobs not yet here are their flags, read on arrival).
        newest = self.client.xrevrange(self.aborts_stream, count=1)
        self.aborts_seen = newest[0][0] if newest else "0-0"
        entries: list[Entry] = []
        cursor: bytes | str = "0-0"
        while True:
            cursor, claimed, _ = self.client.xautoclaim(
                self.stream, WORKER_GROUP, self.consumer, min_idle_time=0, start_id=cursor,
                count=1000,
            )  # fmt: skip
            entries += claimed
            if cursor in (b"0-0", "0-0") or not claimed:
                break
        if entries:
            # XAUTOCLAIM counted our claim too: the deliveries before it went to a dead life.
            for pending in self._pending(self.consumer):
                if pending["times_delivered"] > 1:
                    self.previous_deliveries[pending["message_id"]] = pending["times_delivered"] - 1
        return entries

    def open_log(self) -> None:
        """Make our progress log, or open it again after a reaper closed it: the commits
        from now on write only until a reaper closes it again. (`open` does, else the
        first commit.)"""
        hello = encode(TokenBatch(self.worker_id, 0, []))
        args = [ENTRY_FIELD, self._no_progress, CLOSED_LOG_ID, LOG_READERS_GROUP, hello]
        self._open_log(keys=[self.progress_stream, self.config.tokens_stream()], args=args)
        self._log_opened = True

    def read_blocking(self) -> list[Entry]:
        """New jobs, waiting up to block_ms for some."""
        response = self.client.xreadgroup(
            WORKER_GROUP, self.consumer, {self.stream: ">"},
            count=self.config.read_count, block=self.config.block_ms,
        )  # fmt: skip
        return response[0][1] if response else []

    def commit(self, read: bool) -> list[Entry]:
        """One script call (the log's XADD alone where that is all it writes), valid only
        under our fence: outputs, dead letters, acks, the aborts stream read for
        `abort_checks` (those aborted then in `flagged`), and (optionally) a non-blocking
        read of new jobs. Returns the jobs read; raises `Fenced` (having written nothing)
        when a reaper closed or deleted our log since we opened it."""
        self.trimmer.maybe_trim()
        self.progress_written = None
        self.acked_ended = self._ended_due()
        acks = self.acks + self.acked_ended
        writes = self.outbox or acks or self.dead or self.progress or self.kv_events
        if not (writes or read or self.abort_checks):
            return []
        if not self._log_opened:
            self.open_log()
        log_fields = {ENTRY_FIELD: self.progress or self._no_progress}
        tokens, outputs = self._token_batch()
        if tokens is not None:  # in the same entry: its readers' only input (module docstring)
            log_fields[TOKENS_FIELD] = encode(tokens)
        if not (outputs or acks or self.dead or self.kv_events or self.abort_checks or read
                or self.progress_trim is not None):  # fmt: skip
            return self._log_only(log_fields)
        # One script call, the log's entry first: it is the fence (bus/scripted_multi.py),
        # and its reply is the entry's id. NOMKSTREAM: a log the reaper deleted is a fence.
        pipe = ScriptedMulti(self.client, guarded=True)
        pipe.xadd(self.progress_stream, log_fields, nomkstream=True)
        if self.progress_trim is not None:
            trim = self._log_trim(self.progress_trim)
            pipe.xtrim(self.progress_stream, minid=trim, approximate=False)
        if self.kv_events is not None:  # capped by count: a snapshot follows a cut
            pipe.xadd(self.config.kv_events_stream(), {ENTRY_FIELD: self.kv_events},
                      maxlen=self.config.kv_events_maxlen, approximate=True)  # fmt: skip
        write_outputs(pipe, self.config, outputs)
        write_dead_letters(pipe, self.config, self.dead)
        if acks:
            pipe.xack(self.stream, WORKER_GROUP, *acks)
        checks = self.abort_checks
        if checks:  # bus/aborts.py
            pipe.xread({self.aborts_stream: self.aborts_seen}, count=ABORTS_READ)
        if read:
            pipe.xreadgroup(WORKER_GROUP, self.consumer, {self.stream: ">"},
                            count=self.config.read_count)  # fmt: skip
        try:
            results = execute_logging_errors(pipe, self.who)
        except redis.WatchError as exc:
            raise Fenced from exc
        if self.progress is not None and isinstance(results[0], bytes):
            self.progress_written = results[0]
        if checks:
            found = results[-2 if read else -1]
            if isinstance(found, list) and found:  # else none new, or an error (logged)
                entries = found[0][1]
                self.aborts_seen = entries[-1][0]
                aborted = aborted_rids(entries)
                self.flagged = [rid for rid in checks if rid in aborted]
        self._clear()
        if read and results[-1] and not isinstance(results[-1], redis.ResponseError):
            return results[-1][0][1]
        return []

    def ack_later(self, entry_id: bytes) -> None:
        """Acknowledge `entry_id`, whose job's end the log says (jobs/progress.py ``done``),
        in a later commit: when `ack_ended` asks (the worker ran dry), after
        ``ENDED_ACK_WAIT_S``, or ``ENDED_ACKS_MAX`` of them. Most of a busy worker's commits
        then hold the log's entry alone: one XADD, where a script and an XACK were three
        commands (Redis counts a script's commands, issue 27)."""
        if not self.ended:
            self._ended_since = time.monotonic()
        self.ended.append(entry_id)

    def queued(self) -> tuple[int, ...]:
        """Where the buffers stand, for `drop_since`."""
        return len(self.outbox), len(self.acks), len(self.dead), len(self.ended)

    def drop_since(self, queued: tuple[int, ...]) -> None:
        """Drop what was queued since `queued` (a step that failed queued it)."""
        del self.outbox[queued[0] :], self.acks[queued[1] :], self.dead[queued[2] :]
        del self.ended[queued[3] :]

    def _ended_due(self) -> list[bytes]:
        waited = time.monotonic() - self._ended_since
        if self.ack_ended or waited >= ENDED_ACK_WAIT_S or len(self.ended) >= ENDED_ACKS_MAX:
            return self.ended
        return []

    def _log_only(self, fields: dict[bytes, bytes]) -> list[Entry]:
        """A commit of the log's entry alone: one XADD, its own fence (a log closed or
        deleted refuses it, and nothing is written)."""
        try:
            entry_id = self.client.xadd(self.progress_stream, fields, nomkstream=True)
        except redis.ResponseError as exc:
            if "last possible ID" not in str(exc):
                raise  # not the fence: an outage, or a server out of memory
            raise Fenced from exc
        if entry_id is None:  # deleted
            raise Fenced
        if self.progress is not None:
            self.progress_written = entry_id
        self._clear()
        return []

    def _token_batch(self) -> tuple[TokenBatch | None, list[Output]]:
        """The token batches queued for this commit as one (their items in order), and the
        other outputs. Token batches are queued as outputs to the tokens stream, so that
        what a failed step queued is dropped with the rest (gpu_worker/worker.py)."""
        tokens = self.config.tokens_stream()
        batches = [out.message for out in self.outbox
                   if isinstance(out, Outbound) and out.stream == tokens]  # fmt: skip
        if not batches:
            return None, self.outbox
        others = [out for out in self.outbox
                  if not (isinstance(out, Outbound) and out.stream == tokens)]  # fmt: skip
        if len(batches) == 1:
            return batches[0], others
        items = [item for batch in batches for item in batch.items]
        last = batches[-1]
        return TokenBatch(last.worker_id, last.step, items, weights=last.weights), others

    def _log_trim(self, below: bytes) -> bytes | str:
        """Where to trim our log: below `below` (the oldest entry our jobs still need), and
        never past an entry the detokenizers have not read and acknowledged."""
        floor = trim_floor(self.client, self.progress_stream)
        if floor is None or parse_id(below) <= floor:
            return below
        return f"{floor[0]}-{floor[1]}"

    def restart_fenced(self) -> list[Entry]:
        """After `Fenced`: drop what was not yet written, open our log again, and return the
        entries still pending to us (the reaper did not claim them), to admit again."""
        self._clear()
        self.ended, self.acked_ended = [], []  # the reaper, or our next admission, reads the log
        self.open_log()
        self.ensure_group()  # the reaper may have deleted it
        return self.pending_entries()

    def pending_entries(self) -> list[Entry]:
        """The entries pending to this consumer, read again, less those whose acknowledgement
        is already queued for the next commit."""
        queued = set(self.acks) | set(self.ended)
        ids = [p["message_id"] for p in self._pending(self.consumer)]
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            if entry_id not in queued:
                pipe.xrange(self.stream, entry_id, entry_id)
        return [entry for found in pipe.execute() for entry in found]

    def _pending(self, consumer: str | None = None) -> list[dict[str, Any]]:
        """XPENDING's details (message_id, times_delivered, ...), of one consumer or all."""
        return self.client.xpending_range(
            self.stream, WORKER_GROUP, "-", "+", count=10_000, consumername=consumer
        )

    def take_flagged(self) -> list[str]:
        """The jobs the last commit found aborted, once."""
        flagged, self.flagged = self.flagged, []
        return flagged

    def _clear(self) -> None:
        """After a commit wrote: empty the buffers it wrote."""
        self.outbox, self.acks, self.dead, self.abort_checks = [], [], [], []
        self.progress = self.progress_trim = self.kv_events = None
        if self.acked_ended:  # `ended` itself: what was added since is in a later commit
            self.ended = []
        self.ack_ended = False
