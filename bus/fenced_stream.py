"""A worker's own stream, written to only under its fence; and the reaper's side of that fence.

A worker reads jobs from its stream ``<p>:worker:<id>`` in the consumer group ``worker``
(`WORKER_GROUP`), where the router stage routes them. What a worker writes (its outputs, the
acknowledgements of its jobs, dead letters, an entry of its progress log) waits in the
buffers of its `FencedStream` until the next `commit`, one atomic script call
(bus/scripted_multi.py) that may also carry a non-blocking read of new jobs: while there is
work the bus costs one round trip per publish (gpu_worker/worker.py publishes at most every
``publish_interval_ms``); idle, the worker blocks on its stream (`read_blocking`).

Nothing is lost when a worker dies. A job stays pending on the worker's stream until it
finishes (its acknowledgement goes in the commit with its last tokens), and the commit that
publishes tokens also logs them, for all the worker's jobs at once, on its progress stream
``<p>:progress:<id>`` (jobs/progress.py). When the heartbeat lapses, the router's reaper
(stages/router/worker_reaper.py) moves the pending jobs to the router again, each carrying
the ids the log holds for it, and the worker that gets one continues after them: no token is
repeated or missing. A worker stopped with SIGTERM publishes what it generated and leaves
its jobs to the reaper the same way. A worker started again under the same id takes back the
entries its previous life left pending (`open`) and reads their progress from its own log
(`read_progress_log`); each of those was handed to a worker that died holding it, which
`previous_deliveries` counts for the job's quarantine (jobs/job_failures.py).

A worker taken for dead while alive (paused, or out of reach of Redis for longer than the
heartbeat TTL) must not go on publishing for jobs now served elsewhere: two writers would
send a client two versions of a token and garble the progress log. Every commit first
checks, in the same script call, that the worker's fence key still holds the token the
worker took; the reaper changes it in the MULTI that claims jobs off it (`fence_off`). A
commit that finds the fence changed writes nothing and raises `Fenced`; the worker drops
every job and starts again from `restart_fenced`: the entries still pending to it are its
own, and resume from the log.

The worker trims its stream, at most once per ``trim_interval_s``, below what its group has
acknowledged (bus/stream_trim.py): a job stays on the stream until it finishes. It trims its
progress log below the first entry about the oldest job it holds
(gpu_worker/progress_log.py).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import redis

from bus.actor import unique_consumer_name
from bus.effects import Output, execute_logging_errors, write_dead_letters, write_outputs
from bus.reconnect import ensure_group, is_missing_group
from bus.scripted_multi import ScriptedMulti
from bus.stream_trim import StreamTrimmer
from jobs.progress import ProgressEntry
from jobs.protocol import ENTRY_FIELD, ProtocolError, decode
from runtime.config import BusConfig

logger = logging.getLogger(__name__)

WORKER_GROUP = "worker"  # the workers' consumer group, one per worker stream

Entry = tuple[bytes, dict[bytes, bytes] | None]  # (entry id, fields; None once trimmed)


class Fenced(Exception):  # noqa: N818 (a state the worker recovers from, not an error)
    """The reaper claimed jobs off this worker since its last commit: nothing was written."""


class FencedStream:
    """One worker's consumer on its stream, with the buffers of its next commit."""

    def __init__(self, client: redis.Redis, config: BusConfig, worker_id: str) -> None:
        self.client = client
        self.config = config
        self.who = f"worker {worker_id}"
        self.stream = config.worker_stream(worker_id)
        self.consumer = unique_consumer_name(f"worker-{worker_id}")
        self.fence_key = config.fence_key(worker_id)
        self._fence: bytes | None = None  # the fence token our writes are valid under
        # Written by the next commit, all or nothing:
        self.outbox: list[Output] = []
        self.acks: list[bytes] = []
        self.dead: list[dict[str, Any]] = []  # dead_letter_fields
        self.progress_stream = config.progress_stream(worker_id)
        self.progress: bytes | None = None  # an encoded ProgressEntry, for the log
        self.progress_trim: bytes | None = None  # trim the log below this id (MINID)
        self.progress_written: bytes | None = None  # where the last commit logged `progress`
        self.kv_events: bytes | None = None  # an encoded KvEvents, for the kv-events stream
        # Entry id -> deliveries to a previous life under this id, for the entries `open`
        # took back (read once, when the job is admitted).
        self.previous_deliveries: dict[bytes, int] = {}
        self.trimmer = StreamTrimmer(client, self.stream, config.trim_interval_s)

    def ensure_group(self) -> None:
        ensure_group(self.client, self.stream, WORKER_GROUP)

    def open(self) -> list[Entry]:
        """Make the group, take the current fence, and return the entries a previous life
        under this id left pending: they are ours, to resume from their progress."""
        self.ensure_group()
        self._fence = self.client.get(self.fence_key)
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

    def read_blocking(self) -> list[Entry]:
        """New jobs, waiting up to block_ms for some."""
        response = self.client.xreadgroup(
            WORKER_GROUP, self.consumer, {self.stream: ">"},
            count=self.config.read_count, block=self.config.block_ms,
        )  # fmt: skip
        return response[0][1] if response else []

    def commit(self, read: bool) -> list[Entry]:
        """One script call, valid only under our fence: outputs, dead letters, acks, and
        (optionally) a non-blocking read of new jobs. Returns the jobs read; raises `Fenced`
        (having written nothing) when the fence changed."""
        self.trimmer.maybe_trim()
        self.progress_written = None
        if not (self.outbox or self.acks or self.dead or read or self.progress or self.kv_events):
            return []
        # One script call, checked against the fence first (bus/scripted_multi.py).
        pipe = ScriptedMulti(self.client, fence=(self.fence_key, self._fence))
        if self.progress is not None:  # first: its reply is the entry's id
            pipe.xadd(self.progress_stream, {ENTRY_FIELD: self.progress})
        if self.progress_trim is not None:
            pipe.xtrim(self.progress_stream, minid=self.progress_trim, approximate=False)
        if self.kv_events is not None:  # capped by count: a snapshot follows a cut
            pipe.xadd(self.config.kv_events_stream(), {ENTRY_FIELD: self.kv_events},
                      maxlen=self.config.kv_events_maxlen, approximate=True)  # fmt: skip
        write_outputs(pipe, self.config, self.outbox)
        write_dead_letters(pipe, self.config, self.dead)
        if self.acks:
            pipe.xack(self.stream, WORKER_GROUP, *self.acks)
        if read:
            pipe.xreadgroup(WORKER_GROUP, self.consumer, {self.stream: ">"},
                            count=self.config.read_count)  # fmt: skip
        try:
            results = execute_logging_errors(pipe, self.who)
        except redis.WatchError as exc:
            raise Fenced from exc
        if self.progress is not None and isinstance(results[0], bytes):
            self.progress_written = results[0]
        self._clear()
        if read and results[-1] and not isinstance(results[-1], redis.ResponseError):
            return results[-1][0][1]
        return []

    def restart_fenced(self) -> list[Entry]:
        """After `Fenced`: drop what was not yet written, take the new fence, and return the
        entries still pending to us (the reaper did not claim them), to admit again."""
        self._clear()
        self._fence = self.client.get(self.fence_key)
        self.ensure_group()  # the reaper may have deleted it
        return self.pending_entries()

    def pending_entries(self) -> list[Entry]:
        """The entries pending to this consumer, read again, less those whose acknowledgement
        is already queued for the next commit."""
        queued = set(self.acks)
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

    def _clear(self) -> None:
        self.outbox, self.acks, self.dead = [], [], []
        self.progress = self.progress_trim = self.kv_events = None


def read_progress_log(
    client: redis.Redis, config: BusConfig, worker_id: str
) -> list[ProgressEntry]:
    """Worker `worker_id`'s progress log, oldest first; a malformed entry is skipped (logged)."""
    stream = config.progress_stream(worker_id)
    entries: list[ProgressEntry] = []
    start: bytes | str = "-"
    while True:
        chunk = client.xrange(stream, min=start, count=1000)
        for entry_id, fields in chunk:
            try:
                entries.append(decode((fields or {}).get(ENTRY_FIELD), ProgressEntry))
            except ProtocolError as exc:
                logger.warning("%s: skipping progress entry %s: %s", stream, entry_id, exc)
        if len(chunk) < 1000:
            return entries
        start = b"(" + chunk[-1][0]


def fence_off(
    client: redis.Redis, config: BusConfig, worker_id: str, consumer: str, count: int
) -> tuple[list[Entry], dict[bytes, int]]:
    """The reaper's claim: up to `count` of the worker's pending entries, else of its unread
    ones, taken by `consumer` in the MULTI that gives the worker a new fence token, so their
    old owner can write nothing more about them. Also returns, by entry id, how many times
    each claimed entry had been delivered to a worker (none for unread ones)."""
    stream = config.worker_stream(worker_id)
    try:
        pipe = client.pipeline(transaction=True)
        pipe.set(config.fence_key(worker_id), secrets.token_hex(8))
        # Before the claim counts itself: the deliveries to workers that died holding them.
        pipe.xpending_range(stream, WORKER_GROUP, "-", "+", count=count)
        pipe.xautoclaim(stream, WORKER_GROUP, consumer, min_idle_time=0, start_id="0-0",
                        count=count)  # fmt: skip
        _, pending, (_, entries, _) = pipe.execute()
        if entries:
            return entries, {p["message_id"]: p["times_delivered"] for p in pending}
        response = client.xreadgroup(WORKER_GROUP, consumer, {stream: ">"}, count=count)
    except redis.ResponseError as exc:
        if not is_missing_group(exc):
            raise
        # Jobs routed before the worker ever made its group: read them from the start.
        ensure_group(client, stream, WORKER_GROUP)
        return fence_off(client, config, worker_id, consumer, count)
    return (response[0][1] if response else []), {}
