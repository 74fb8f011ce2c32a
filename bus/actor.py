"""The stage runtime: an actor on a consumer group of one input stream (and, for a stage
that names them, extra inputs read in the same XREADGROUP: bus/extra_inputs.py).

One turn of the loop: ``XREADGROUP`` (COUNT > 1, bounded BLOCK) a batch of entries, decode
them, let the stage turn the good ones into output messages, then ``XADD`` the outputs and
``XACK`` the inputs in one MULTI: a crash before the EXEC leaves the inputs pending (another
consumer claims them), a crash after it has handed them on. A ``replayable`` stage (the
detokenizer: its readers drop a delta they already have by its ``seq``) pipelines its
outputs without the MULTI and acknowledges its inputs with its next read, in that read's
round trip, once the writes have answered (a full Redis refuses an XADD, not an XACK): a
crash in between writes them again, and a publish costs two commands less (issue 27).
Entries that are not messages the stage accepts, or that make the stage raise, go to the
dead-letter stream with the reason, and the stage keeps running. Entries left pending by a
dead consumer are taken over with ``XAUTOCLAIM`` once idle for ``claim_idle_ms``; one
delivered more than ``max_deliveries`` times is dead-lettered (it may be what killed its
consumers: bus/stale_claims.py). An entry of the job streams may bundle several jobs
(jobs/wire.py): each is handled (or dead-lettered) on its own and the entry acknowledged
once; a bundle claimed after a delivery is split into single-job entries first, so one
poison job cannot take its bundle-mates down. A stage that cannot handle a batch yet raises
`HoldBatch`: nothing is written or acknowledged. A MULTI refused because Redis is full (OOM)
is retried like an outage: nothing acknowledged. Every few seconds a replica trims its input
stream below what every group acknowledged (bus/stream_trim.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from bus.effects import (
    Output,
    dead_letter_fields,
    execute_logging_errors,
    reply,
    write_dead_letters,
    write_outputs,
)
from bus.extra_inputs import ExtraInputs, by_stream
from bus.reconnect import REDIS_TRANSIENT, ReconnectingLoop, ensure_group, is_missing_group
from bus.stale_claims import Read, StaleClaims, requester
from bus.stream_trim import StreamTrimmer
from jobs.job_failures import failure_reply, malformed_reply
from jobs.protocol import (
    JOBS_FIELD,
    Message,
    ProtocolError,
    decode,
    encode,
    job_payloads,
)
from observability.metrics import ProcessMetrics
from observability.stage_metrics import StageMetrics
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


class HoldBatch(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by a stage to leave its batch pending (unacknowledged) for later or another
    replica, e.g. when the stage is stopping while it waits."""


@dataclass
class Inbound:
    entry_id: bytes
    message: Message
    stream: str = ""  # the stream it came from ("": the stage's own)


class Stage(Protocol):
    group: str  # consumer group name, shared by all replicas of the stage
    accepts: tuple[type[Message], ...]

    def input_stream(self, config: BusConfig) -> str: ...

    def handle(self, batch: list[Inbound]) -> list[Output]: ...

    # Optional: `committed()`, called once the outputs of its last `handle` are in Redis (the
    # detokenizer counts a reply stream's expiry renewed only then); `reconnected()`, called
    # at the start and after each outage, when Redis may have come back empty; `replayable`,
    # True where writing a batch's outputs twice is harmless (the module docstring says why);
    # `extra_inputs()`, the streams it reads besides its own, whose entries carry its
    # messages in `extra_field` (bus/extra_inputs.py: the detokenizer's workers' logs).


def unique_consumer_name(kind: str) -> str:
    """Host, pid and a random suffix: two replicas never share a name, even after a restart."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Actor(StaleClaims):
    """Runs one stage replica; `run` until `stop` is set."""

    def __init__(
        self,
        client: redis.Redis,
        config: BusConfig,
        stage: Stage,
        stop: threading.Event | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.stage = stage
        self.stream = stage.input_stream(config)
        self.consumer = unique_consumer_name(stage.group)
        self.stop = stop if stop is not None else threading.Event()
        if hasattr(stage, "keep_alive"):
            # A stage that may hold a batch a while keeps it from being claimed with this.
            stage.keep_alive = self.touch
        self._next_claim = 0.0
        # XAUTOCLAIM resumes where it left off, on each stream.
        self._claim_cursors: dict[str, bytes | str] = {}
        self._unfinished: Read = []  # a turn Redis refused (an outage, OOM): retried
        self._replayable = bool(getattr(stage, "replayable", False))
        # A replayable stage's written inputs, by stream, acknowledged with its next read.
        self._acks: dict[str, list[bytes]] = {}
        self.extra = ExtraInputs(client, stage.group, getattr(stage, "extra_inputs", None))
        self._extra_field: bytes | None = getattr(stage, "extra_field", None)
        self._read_own = False  # the last read brought entries of our own stream
        self.processed = 0
        self.dead_lettered = 0
        self.metrics = StageMetrics(ProcessMetrics(stage.group, self.consumer, config.metrics))
        self.trimmer = StreamTrimmer(client, self.stream, config.trim_interval_s)
        self._waiting_for_entries = False  # in the blocked read: a stop signal may end it

    def run(self) -> None:
        logger.info("%s: consumer %s on %s", self.stage.group, self.consumer, self.stream)
        loop = ReconnectingLoop(self.stage.group, self.stop, self._ensure_group)
        try:
            loop.run(self.run_once)
        finally:
            self._flush_acks_on_exit()

    def _ensure_group(self) -> None:
        """At the start and after every outage: Redis may be back empty, without our group and
        without any key a stage remembers writing."""
        ensure_group(self.client, self.stream, self.stage.group)
        if hasattr(self.stage, "reconnected"):
            self.stage.reconnected()

    def run_once(self) -> int:
        """One read-handle-commit turn (plus a claim of stale entries and a trim when due)."""
        self.trimmer.maybe_trim()
        reads = self._still_ours(self._unfinished)
        self._unfinished = []
        if not reads and time.monotonic() >= self._next_claim:
            self.flush_acks()  # before a claim, which must not take back what we handled
            reads = self._claim_stale()
        if not reads:
            reads = self._read_new()
        count = sum(len(entries) for _, entries in reads)
        if count:
            try:
                self.process(reads)
            except HoldBatch:
                logger.info("%s: holding %d entries", self.stage.group, count)
            except REDIS_TRANSIENT:
                # Handled again next turn, by us: a claim would count one more delivery,
                # and an outage (a full Redis) is no fault of the entries.
                self._unfinished = list(reads)
                raise
        return count

    def _read_new(self) -> Read:
        """XREADGROUP a batch off our stream and the extra inputs, with the last turn's
        acknowledgements (a replayable stage's) in the same round trip."""
        # After a turn that read our own stream (where a writer says it opened one: the stage
        # has handled that word now), the extra inputs are asked for at once.
        self.extra.maybe_refresh(force=self._read_own)
        self._read_own = False
        streams = dict.fromkeys([self.stream, *self.extra.streams], ">")
        read_args = (self.stage.group, self.consumer, streams)
        read_options = {"count": self.config.read_count, "block": self.config.block_ms}
        pipe = self.client.pipeline(transaction=False)
        for stream, entry_ids in self._acks.items():
            pipe.xack(stream, self.stage.group, *entry_ids)
        pipe.xreadgroup(*read_args, **read_options)
        try:
            self._waiting_for_entries = True
            response = pipe.execute(raise_on_error=False)[-1]
        except _ReadInterrupted:
            return []  # stopping; the acknowledgements are sent on the way out
        finally:
            self._waiting_for_entries = False
        self._acks = {}
        if isinstance(response, redis.ResponseError):
            ours = f"'{self.stream}'" in str(response)
            if not self.extra.streams or not is_missing_group(response) or ours:
                raise response
            self.extra.lost()  # an extra input is gone (a dead worker's log, read through)
            return []
        reads = by_stream(response)
        self._read_own = any(stream == self.stream for stream, _ in reads)
        return reads

    def interrupt_read(self) -> None:
        """From a stop signal's handler: end the read blocked waiting for entries now, not
        when its block_ms runs out (a stage's stop took up to a second). Only that read:
        a batch in hand is finished first. redis-py drops the connection the read was on."""
        if self._waiting_for_entries:
            raise _ReadInterrupted

    def flush_acks(self) -> None:
        """Acknowledge at once what a replayable stage has written and not yet acknowledged."""
        if self._acks:
            pipe = self.client.pipeline(transaction=False)
            for stream, entry_ids in self._acks.items():
                pipe.xack(stream, self.stage.group, *entry_ids)
            pipe.execute()
            self._acks = {}

    def _flush_acks_on_exit(self) -> None:
        try:
            self.flush_acks()
        except (*REDIS_TRANSIENT, redis.ResponseError) as exc:  # left pending: claimed later
            logger.warning("%s: could not acknowledge %d handled entries on exit: %s",
                           self.stage.group, sum(map(len, self._acks.values())), exc)  # fmt: skip

    def _still_ours(self, reads: Read) -> Read:
        """Of entries a failed turn left pending, those no peer has claimed since. Those of
        an extra input whose group is gone went with it (Redis came back empty, or a reaper
        deleted the log), and are dropped: asked about again, they failed every turn, in a
        spin, until a writer made that stream anew."""
        ours: Read = []
        for stream, entries in reads:
            try:
                pending = self.client.xpending_range(
                    stream, self.stage.group, "-", "+", count=len(entries) + 1000,
                    consumername=self.consumer,
                )  # fmt: skip
            except redis.ResponseError as exc:
                if stream == self.stream or not is_missing_group(exc):
                    raise  # our own group: the reconnecting loop makes it again
                self.extra.lost()
                continue
            held = {p["message_id"] for p in pending}
            kept = [entry for entry in entries if entry[0] in held]
            if kept:
                ours.append((stream, kept))
        return ours

    def process(self, reads: Read) -> None:
        """Handle entries, by the stream they came from, and commit what they make."""
        started = time.perf_counter()
        good: list[Inbound] = []
        dead: list[dict[str, Any]] = []
        refusals: list[Output] = []
        for stream, entries in reads:
            for entry_id, fields in entries:
                self._decode_entry(stream, entry_id, fields, good, dead, refusals)
        outputs = refusals + self._handle(good, dead)
        acks = {stream: [entry_id for entry_id, _ in entries] for stream, entries in reads}
        self._commit(acks, outputs, dead)
        if hasattr(self.stage, "committed"):  # what it wrote is in Redis now (the detokenizer)
            self.stage.committed()
        count = sum(len(entries) for _, entries in reads)
        self.processed += count
        self.metrics.entries.inc(count)
        self.metrics.batch_size.observe(count)
        self.metrics.handle_seconds.observe(time.perf_counter() - started)

    def _decode_entry(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes] | None,
                      good: list[Inbound], dead: list[dict[str, Any]],
                      refusals: list[Output]) -> None:  # fmt: skip
        """An entry's messages into `good`, or its dead letters into `dead` (and the
        answers to their requesters into `refusals`)."""
        if fields is None:
            # Deleted while pending: the bus never trims an unacknowledged entry
            # (bus/stream_trim.py), so only an XDEL or XTRIM by hand gets here. Its
            # requester cannot be answered (its reply_to went with it); people can.
            reason = "deleted from the stream while pending; its requester got no reply"
            dead.append(dead_letter_fields(stream, entry_id, reason, None))
            return
        try:
            payloads = self._payloads(stream, fields)  # one, or each job of a bundle entry
        except ProtocolError as exc:  # a malformed bundle: refused whole
            dead.append(dead_letter_fields(stream, entry_id, str(exc), fields.get(JOBS_FIELD)))
            return
        for payload in payloads:
            try:
                good.append(Inbound(entry_id, decode(payload, *self.stage.accepts), stream))
            except ProtocolError as exc:  # this job alone: its bundle-mates go on
                dead.append(dead_letter_fields(stream, entry_id, str(exc), payload))
                answer = malformed_reply(payload, exc)
                if answer is not None:
                    refusals.append(reply(self.config, *answer))

    def _payloads(self, stream: str, fields: dict[bytes, bytes]) -> list[bytes | None]:
        """The messages an entry carries: on our stream its ``m`` or its bundle's jobs; on an
        extra input its `extra_field` (none: an entry not for us, acknowledged unread)."""
        if stream == self.stream:
            return job_payloads(fields)
        return [fields[self._extra_field]] if self._extra_field in fields else []

    def _handle(self, good: list[Inbound], dead: list[dict[str, Any]]) -> list[Output]:
        if not good:
            return []
        try:
            return self.stage.handle(good)
        except (HoldBatch, *REDIS_TRANSIENT):
            raise  # not the entries' fault: leave them pending
        except Exception:
            logger.exception("%s: a batch of %d failed; retrying one by one",
                             self.stage.group, len(good))  # fmt: skip
        outputs: list[Output] = []
        for inbound in good:  # find the entries that fail on their own
            try:
                outputs.extend(self.stage.handle([inbound]))
            except (HoldBatch, *REDIS_TRANSIENT):
                raise
            except Exception as exc:  # this entry's own failure, whatever it raised
                reason = f"{self.stage.group} failed on it: {type(exc).__name__}: {exc}"[:1000]
                logger.exception("%s: dead-lettering %s", self.stage.group, inbound.entry_id)
                dead.append(dead_letter_fields(inbound.stream or self.stream,
                                               inbound.entry_id, reason,
                                               _payload_of(inbound.message)))  # fmt: skip
                address = requester(inbound.message)
                if address is not None:
                    rid, reply_to = address
                    answer = failure_reply(rid, exc, self.stage.group)
                    outputs.append(reply(self.config, reply_to, answer))
        return outputs

    def _commit(
        self, acks: dict[str, list[bytes]], outputs: list[Output], dead: list[dict[str, Any]]
    ) -> None:
        """Write `outputs` and `dead` and acknowledge `acks` (entry ids by stream)."""
        deferred = self._replayable and not dead  # dead letters are not replayable
        pipe = self.client.pipeline(transaction=not deferred)
        write_outputs(pipe, self.config, outputs)
        write_dead_letters(pipe, self.config, dead)
        for stream, entry_ids in acks.items():
            if entry_ids and not deferred:
                pipe.xack(stream, self.stage.group, *entry_ids)
        execute_logging_errors(pipe, self.stage.group)
        if deferred:
            for stream, entry_ids in acks.items():
                self._acks.setdefault(stream, []).extend(entry_ids)
        self.dead_lettered += len(dead)
        if dead:
            self.metrics.dead_letters.inc(len(dead))
            logger.warning("%s: dead-lettered %d entries: %s", self.stage.group, len(dead),
                           "; ".join(str(d["reason"]) for d in dead[:3]))  # fmt: skip

    def touch(self, entry_ids: list[bytes]) -> None:
        # The jobs of one bundle entry share its id: each id once.
        touch(self.client, self.stream, self.stage.group, self.consumer,
              list(dict.fromkeys(entry_ids)))  # fmt: skip


def _payload_of(message: Message) -> bytes:
    """The message as it was on the stream, for a dead letter (b"" if it will not encode)."""
    try:
        return encode(message)
    except Exception:  # a dead letter must be written even for what cannot be re-encoded
        return b""


def touch(client: redis.Redis, stream: str, group: str, consumer: str, ids: list[bytes]) -> None:
    """Reset the idle time of entries this consumer holds, so no replica claims them."""
    if ids:
        client.xclaim(stream, group, consumer, min_idle_time=0, message_ids=ids, justid=True)


class _ReadInterrupted(Exception):
    """Raised by a stop signal's handler into a read blocked waiting for entries."""


def stop_on_signals(stop: threading.Event, wake: Callable[[], None] | None = None) -> None:
    """SIGTERM and SIGINT end the loop after the batch in hand (main thread only). `wake`,
    called in the handler once `stop` is set, ends a wait that would see the stop only when
    it times out (`Actor.interrupt_read`, `JobIntake.wake`)."""

    def handler(signum: int, _frame: Any) -> None:
        logger.info("signal %d: stopping after the current batch", signum)
        stop.set()
        if wake is not None:
            wake()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
