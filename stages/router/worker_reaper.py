"""The worker reaper: a dead worker's jobs go back to the router, to continue elsewhere.

A worker leaves every job it was handed pending on its stream (``<p>:worker:<id>``) until
the job finishes, and logs the tokens it publishes on its progress stream
(``<p>:progress:<id>``, jobs/progress.py) in the commit that publishes them
(bus/fenced_stream.py). So when its heartbeat lapses — it was killed, it crashed, or SIGTERM
stopped it — its stream holds the jobs it had not finished, and its log exactly what their
clients were sent. A job may still be pending after it ended (its acknowledgement may wait
for a later commit): the log's entry with its last tokens marks it ended (jobs/progress.py
``done``), and such a job is acknowledged and not moved.

Each router replica runs a reaper thread. For a worker whose heartbeat is gone
(bus/liveness.py: its id still in the workers set, its heartbeat key expired) on two looks a
heartbeat interval apart (a router that read the heartbeat just before it
expired has routed its job by then), the replica that wins the worker's ``reaping`` lock
takes every entry of its stream (pending ones with ``XAUTOCLAIM``, unread ones with
``XREADGROUP``) and puts each job back on the tokenized stream with the ids the log holds
for it in its ``progress`` field, acknowledging it in the same MULTI. The router routes it
to a live worker (or holds it while none is alive, failing it after
``no_worker_timeout_s``), and that worker continues after the progress: no token is
repeated or missing. Once the stream is empty, and the heartbeat still absent, the stream,
its log, the id and its routing count go in one MULTI guarded by WATCH.

Each job handed to the dead worker counts one more attempt (the job's ``attempts`` field,
jobs/job_failures.py): a job that killed its workers ``max_deliveries`` times is not handed
to another, but dead-lettered with an error reply to its requester.

A worker taken for dead may be alive (paused, or cut off from Redis for longer than the
TTL). So each claim goes in one MULTI that closes the worker's progress log, which every
commit of the worker writes first and which then refuses it (bus/fence_off.py): once a job
is claimed, its old worker can publish nothing more, and the progress the next worker
resumes from is final.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

from bus.effects import (
    Outbound,
    dead_letter_fields,
    execute_logging_errors,
    reply,
    write_dead_letters,
    write_outputs,
)
from bus.fence_off import fence_off, read_progress_log
from bus.fenced_stream import LOG_READERS_GROUP, WORKER_GROUP
from bus.liveness import read_liveness
from bus.reconnect import REDIS_TRANSIENT
from bus.stream_trim import parse_id
from jobs.job_failures import malformed_reply, too_many_deliveries
from jobs.progress import ProgressEntry, ended_jobs, rebuild
from jobs.protocol import (
    ENTRY_FIELD,
    JOBS_FIELD,
    TOKENS_FIELD,
    Abort,
    ProtocolError,
    TokenizedRequest,
    decode,
    job_payloads,
)
from observability.metrics import ProcessMetrics
from runtime.config import BusConfig

logger = logging.getLogger(__name__)

BATCH = 256
LOCK_TTL_S = 30


def dead_worker_ids(client: redis.Redis, config: BusConfig) -> set[str]:
    """Ids in the workers set whose heartbeat key is gone (a malformed one is not gone)."""
    return set(read_liveness(client, config).lapsed)


class WorkerReaper:
    def __init__(
        self,
        client: redis.Redis,
        config: BusConfig,
        consumer: str,
        stop: threading.Event,
        metrics: ProcessMetrics | None = None,  # the router's, which counts the jobs moved
    ) -> None:
        self.client = client
        self.config = config
        self.consumer = consumer
        self.stop = stop
        self._seen_dead: set[str] = set()
        self._log: list[ProgressEntry] | None = None  # of the worker being reaped
        self._ended: set[str] = set()  # the jobs its log says ended, read with it
        self.moved = 0  # jobs put back on the tokenized stream
        metrics = metrics or ProcessMetrics("router", consumer, enabled=False)
        self.migrated_out = metrics.counter(
            "worker_jobs_migrated_out", "Jobs moved off a dead worker to live ones.", ["worker"]
        )

    def run(self) -> None:
        """Look for dead workers every heartbeat interval until `stop` is set."""
        while not self.stop.wait(self.config.heartbeat_interval_s):
            try:
                self.tick()
            except REDIS_TRANSIENT as exc:
                logger.warning("reaper: Redis unreachable (%s); retrying", exc)
            except Exception:  # a reaper that dies would strand every later dead worker
                logger.exception("reaper: a pass failed; retrying")

    def tick(self) -> None:
        dead = dead_worker_ids(self.client, self.config)
        for worker_id in sorted(dead & self._seen_dead):
            self.reap(worker_id)
        self._seen_dead = dead

    def reap(self, worker_id: str) -> bool:
        """Move `worker_id`'s jobs back to the router and forget it; False if another
        replica holds its lock or the worker came back."""
        lock = self.config.reaping_key(worker_id)
        if not self.client.set(lock, self.consumer, nx=True, ex=LOCK_TTL_S):
            return False
        self._log = None  # read once its fence has changed
        try:
            stream = self.config.worker_stream(worker_id)
            while not self.stop.is_set():
                if self._move_entries(worker_id, stream):
                    continue
                if self.client.exists(self.config.heartbeat_key(worker_id)):
                    logger.info("reaper: worker %s is beating again; left alone", worker_id)
                    return False
                if self._forget(worker_id, stream):
                    return True
            return False
        finally:
            self.client.delete(lock)

    def _move_entries(self, worker_id: str, stream: str) -> int:
        """Requeue one batch of the stream's pending and unread jobs; how many entries."""
        if not self.client.exists(stream):
            return 0
        entries, deliveries = fence_off(self.client, self.config, worker_id, self.consumer, BATCH)
        if not entries:
            return 0
        if self._log is None:  # final: the worker can write nothing since the fence changed
            self._log = read_progress_log(self.client, self.config, worker_id)
            self._ended = ended_jobs(self._log)  # only their acknowledgements were not written
        pipe = self.client.pipeline(transaction=True)
        moving: list[TokenizedRequest] = []
        for entry_id, fields in entries:
            if fields is None:
                continue  # trimmed while pending
            try:  # one job, or a router batch's bundle (jobs/wire.py), refused whole
                payloads = job_payloads(fields)
            except ProtocolError as exc:
                self._set_aside(pipe, stream, entry_id, fields.get(JOBS_FIELD), str(exc), None)
                continue
            for payload in payloads:
                message = self._job(pipe, stream, entry_id, payload, deliveries.get(entry_id, 0))
                if message is not None and message.rid not in self._ended:
                    moving.append(message)
        carried = {job.rid: list(job.progress or []) for job in moving}
        progress = rebuild(self._log, carried)
        for job in moving:
            job.progress = progress[job.rid] or None
        # One bundle entry for them all (jobs/wire.py), as the tokenizer writes them.
        write_outputs(pipe, self.config, [Outbound(self.config.tokenized_stream(), job)
                                          for job in moving])  # fmt: skip
        moved = len(moving)
        pipe.xack(stream, WORKER_GROUP, *[entry_id for entry_id, _ in entries])
        execute_logging_errors(pipe, "reaper")
        self.moved += moved
        if moved:
            self.migrated_out.labels(worker_id).inc(moved)
            logger.warning("reaper: moved %d jobs off %s to live workers", moved, stream)
        return len(entries)

    def _job(self, pipe: Any, stream: str, entry_id: bytes, payload: bytes | None,
             deliveries: int) -> TokenizedRequest | None:  # fmt: skip
        """The job to move, with one more attempt for each time a worker died holding it;
        None for an Abort (its job, if still here, is moved and meets the abort flag there)
        and for a job set aside (malformed, or its workers died too often holding it)."""
        try:
            message = decode(payload, TokenizedRequest, Abort)
        except ProtocolError as exc:
            self._set_aside(pipe, stream, entry_id, payload, str(exc),
                            malformed_reply(payload, exc))  # fmt: skip
            return None
        if isinstance(message, Abort):
            return None
        message.attempts = (message.attempts or 0) + deliveries
        if message.attempts >= self.config.max_deliveries:
            answer = too_many_deliveries(message.rid, message.attempts)
            self._set_aside(pipe, stream, entry_id, payload,
                            f"its workers died {message.attempts} times holding it",
                            (message.reply_to, answer))  # fmt: skip
            return None
        return message

    def _set_aside(self, pipe: Any, stream: str, entry_id: bytes, payload: bytes | None,
                   reason: str, answer: tuple[str, Any] | None) -> None:  # fmt: skip
        """Dead-letter a job instead of moving it, and answer its requester."""
        logger.warning("reaper: setting %s aside: %s", entry_id, reason)
        write_dead_letters(pipe, self.config, [dead_letter_fields(stream, entry_id, reason,
                                                                  payload)])  # fmt: skip
        if answer is not None:
            reply(self.config, *answer).apply(pipe, self.config)

    def _forget(self, worker_id: str, stream: str) -> bool:
        """Delete the empty stream, the log and the worker's id, unless it beat or got a job
        meanwhile. The token batches in its log that the detokenizers have not acknowledged
        go to the tokens stream, which they read too: none is lost with the log (one they
        were handling comes twice, and its readers drop the copy)."""
        heartbeat = self.config.heartbeat_key(worker_id)
        log = self.config.progress_stream(worker_id)
        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(stream, heartbeat, log)
                if pipe.exists(heartbeat) or self._has_entries(pipe, stream):
                    pipe.unwatch()
                    return False
                unread = _unread_tokens(pipe, log)
                pipe.multi()
                for payload in unread:
                    pipe.xadd(self.config.tokens_stream(), {ENTRY_FIELD: payload})
                # The log too: a worker taken for dead while alive finds none, and is fenced.
                pipe.delete(stream, self.config.progress_stream(worker_id),
                            self.config.legacy_fence_key(worker_id))  # fmt: skip
                pipe.srem(self.config.workers_key(), worker_id)
                pipe.hdel(self.config.routed_key(), worker_id)
                pipe.execute()
            except redis.WatchError:
                return False
        logger.info("reaper: worker %s is gone", worker_id)
        return True

    @staticmethod
    def _has_entries(pipe: Any, stream: str) -> bool:
        """Whether the worker group still has unread or pending entries on `stream`."""
        if not pipe.exists(stream):
            return False
        last_id = pipe.xinfo_stream(stream)["last-generated-id"]
        for group in pipe.xinfo_groups(stream):
            if group["name"] in (WORKER_GROUP, WORKER_GROUP.encode()):
                return bool(group["pending"]) or group["last-delivered-id"] != last_id
        return pipe.xlen(stream) > 0


def _unread_tokens(pipe: Any, log: str) -> list[bytes]:
    """The token batches in a worker's log that the detokenizers have not acknowledged:
    pending to one of them, or not yet read (bus/fenced_stream.py)."""
    try:
        groups = pipe.xinfo_groups(log)
    except redis.ResponseError:
        return []  # no log
    names = [g["name"].decode() if isinstance(g["name"], bytes) else g["name"] for g in groups]
    if LOG_READERS_GROUP not in names:
        return []  # an older worker's log: its tokens went to the tokens stream
    group = groups[names.index(LOG_READERS_GROUP)]
    last = parse_id(group["last-delivered-id"])
    pending: set[bytes] = set()
    start: bytes | str = b"(" + _id_bytes(group["last-delivered-id"])
    if group["pending"]:
        held = pipe.xpending_range(log, LOG_READERS_GROUP, "-", "+", count=group["pending"])
        pending = {p["message_id"] for p in held}
        start = min(pending, key=parse_id)
    return [
        fields[TOKENS_FIELD]
        for entry_id, fields in pipe.xrange(log, min=start)
        if TOKENS_FIELD in fields and (entry_id in pending or parse_id(entry_id) > last)
    ]


def _id_bytes(entry_id: bytes | str) -> bytes:
    return entry_id if isinstance(entry_id, bytes) else entry_id.encode()


def start_reaper_thread(
    config: BusConfig, consumer: str, stop: threading.Event, metrics: ProcessMetrics | None = None
) -> WorkerReaper:
    """A reaper on its own connection, in a daemon thread."""
    assert config.redis_url is not None
    client = redis.Redis.from_url(config.redis_url)
    reaper = WorkerReaper(client, config, consumer, stop, metrics)
    threading.Thread(target=reaper.run, name="worker-reaper", daemon=True).start()
    return reaper
