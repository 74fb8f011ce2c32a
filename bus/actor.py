"""The stage runtime: an actor on a consumer group of one input stream.

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
consumers). An entry of the job streams may bundle several jobs (jobs/wire.py): each is
handled (or dead-lettered) on its own and the entry acknowledged once; a bundle claimed
after a delivery is split into single-job entries first, so one poison job cannot take its
bundle-mates down. A stage that cannot handle a batch yet raises `HoldBatch`: nothing is
written or acknowledged. A MULTI refused because Redis is full (OOM) is retried like an
outage: nothing acknowledged.
Every few seconds a replica trims its input stream below what every group acknowledged
(bus/stream_trim.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from bus.effects import (
    Outbound,
    Output,
    dead_letter_fields,
    execute_logging_errors,
    reply,
    write_dead_letters,
    write_outputs,
)
from bus.reconnect import REDIS_TRANSIENT, ReconnectingLoop, ensure_group
from bus.stream_trim import StreamTrimmer
from jobs.job_failures import failure_reply, malformed_reply, too_many_deliveries
from jobs.protocol import (
    ENTRY_FIELD,
    JOBS_FIELD,
    Message,
    ProtocolError,
    bundle_payloads,
    decode,
    encode,
    job_payloads,
)
from observability.metrics import ProcessMetrics
from observability.stage_metrics import StageMetrics
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


Entry = tuple[bytes, dict[bytes, bytes] | None]  # (entry id, fields; None once deleted)


class HoldBatch(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by a stage to leave its batch pending (unacknowledged) for later or another
    replica, e.g. when the stage is stopping while it waits."""


@dataclass
class Inbound:
    entry_id: bytes
    message: Message


class Stage(Protocol):
    group: str  # consumer group name, shared by all replicas of the stage
    accepts: tuple[type[Message], ...]

    def input_stream(self, config: BusConfig) -> str: ...

    def handle(self, batch: list[Inbound]) -> list[Output]: ...

    # Optional: `committed()`, called once the outputs of its last `handle` are in Redis (the
    # detokenizer counts a reply stream's expiry renewed only then); `reconnected()`, called
    # at the start and after each outage, when Redis may have come back empty; `replayable`,
    # True where writing a batch's outputs twice is harmless (the module docstring says why).


def unique_consumer_name(kind: str) -> str:
    """Host, pid and a random suffix: two replicas never share a name, even after a restart."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def requester(message: Message) -> tuple[str, str] | None:
    """(rid, reply_to) of a message that says who is waiting for it."""
    rid, reply_to = getattr(message, "rid", None), getattr(message, "reply_to", None)
    if not isinstance(rid, str) or not isinstance(reply_to, str):
        return None
    return rid, reply_to


class Actor:
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
        self._claim_cursor: bytes | str = "0-0"  # XAUTOCLAIM resumes where it left off
        self._unfinished: list[Entry] = []  # a turn Redis refused (an outage, OOM): retried
        self._replayable = bool(getattr(stage, "replayable", False))
        self._acks: list[bytes] = []  # a replayable stage's written inputs, acked with a read
        self.processed = 0
        self.dead_lettered = 0
        self.metrics = StageMetrics(ProcessMetrics(stage.group, self.consumer, config.metrics))
        self.trimmer = StreamTrimmer(client, self.stream, config.trim_interval_s)

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
        entries = self._still_ours(self._unfinished)
        self._unfinished = []
        if not entries and time.monotonic() >= self._next_claim:
            self.flush_acks()  # before a claim, which must not take back what we handled
            entries = self._claim_stale()
        if not entries:
            entries = self._read_new()
        if entries:
            try:
                self.process(entries)
            except HoldBatch:
                logger.info("%s: holding %d entries", self.stage.group, len(entries))
            except REDIS_TRANSIENT:
                # Handled again next turn, by us: a claim would count one more delivery,
                # and an outage (a full Redis) is no fault of the entries.
                self._unfinished = list(entries)
                raise
        return len(entries)

    def _read_new(self) -> list[Entry]:
        """XREADGROUP a batch, with the last turn's acknowledgements (a replayable stage's)
        in the same round trip."""
        read_args = (self.stage.group, self.consumer, {self.stream: ">"})
        read_options = {"count": self.config.read_count, "block": self.config.block_ms}
        if not self._acks:
            response = self.client.xreadgroup(*read_args, **read_options)
        else:
            pipe = self.client.pipeline(transaction=False)
            pipe.xack(self.stream, self.stage.group, *self._acks)
            pipe.xreadgroup(*read_args, **read_options)
            _, response = pipe.execute()
            self._acks = []
        return response[0][1] if response else []

    def flush_acks(self) -> None:
        """Acknowledge at once what a replayable stage has written and not yet acknowledged."""
        if self._acks:
            self.client.xack(self.stream, self.stage.group, *self._acks)
            self._acks = []

    def _flush_acks_on_exit(self) -> None:
        try:
            self.flush_acks()
        except (*REDIS_TRANSIENT, redis.ResponseError) as exc:  # left pending: claimed later
            logger.warning("%s: could not acknowledge %d handled entries on exit: %s",
                           self.stage.group, len(self._acks), exc)  # fmt: skip

    def _still_ours(self, entries: list[Entry]) -> list[Entry]:
        """Of entries a failed turn left pending, those no peer has claimed since."""
        if not entries:
            return []
        pending = self.client.xpending_range(
            self.stream, self.stage.group, "-", "+", count=len(entries) + 1000,
            consumername=self.consumer,
        )  # fmt: skip
        ours = {p["message_id"] for p in pending}
        return [entry for entry in entries if entry[0] in ours]

    def process(self, entries: Sequence[tuple[bytes, dict[bytes, bytes] | None]]) -> None:
        started = time.perf_counter()
        good: list[Inbound] = []
        dead: list[dict[str, Any]] = []
        refusals: list[Output] = []
        for entry_id, fields in entries:
            if fields is None:
                # Deleted while pending: the bus never trims an unacknowledged entry
                # (bus/stream_trim.py), so only an XDEL or XTRIM by hand gets here. Its
                # requester cannot be answered (its reply_to went with it); people can.
                reason = "deleted from the stream while pending; its requester got no reply"
                dead.append(dead_letter_fields(self.stream, entry_id, reason, None))
                continue
            try:
                payloads = job_payloads(fields)  # one, or each job of a bundle entry
            except ProtocolError as exc:  # a malformed bundle: refused whole
                dead.append(dead_letter_fields(self.stream, entry_id, str(exc),
                                               fields.get(JOBS_FIELD)))  # fmt: skip
                continue
            for payload in payloads:
                try:
                    good.append(Inbound(entry_id, decode(payload, *self.stage.accepts)))
                except ProtocolError as exc:  # this job alone: its bundle-mates go on
                    dead.append(dead_letter_fields(self.stream, entry_id, str(exc), payload))
                    answer = malformed_reply(payload, exc)
                    if answer is not None:
                        refusals.append(reply(self.config, *answer))
        outputs = refusals + self._handle(good, dead)
        self._commit([entry_id for entry_id, _ in entries], outputs, dead)
        if hasattr(self.stage, "committed"):  # what it wrote is in Redis now (the detokenizer)
            self.stage.committed()
        self.processed += len(entries)
        self.metrics.entries.inc(len(entries))
        self.metrics.batch_size.observe(len(entries))
        self.metrics.handle_seconds.observe(time.perf_counter() - started)

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
                dead.append(dead_letter_fields(self.stream, inbound.entry_id, reason,
                                               _payload_of(inbound.message)))  # fmt: skip
                address = requester(inbound.message)
                if address is not None:
                    rid, reply_to = address
                    answer = failure_reply(rid, exc, self.stage.group)
                    outputs.append(reply(self.config, reply_to, answer))
        return outputs

    def _commit(
        self, entry_ids: list[bytes], outputs: list[Output], dead: list[dict[str, Any]]
    ) -> None:
        deferred = self._replayable and not dead  # dead letters are not replayable
        pipe = self.client.pipeline(transaction=not deferred)
        write_outputs(pipe, self.config, outputs)
        write_dead_letters(pipe, self.config, dead)
        if entry_ids and not deferred:
            pipe.xack(self.stream, self.stage.group, *entry_ids)
        execute_logging_errors(pipe, self.stage.group)
        if deferred:
            self._acks.extend(entry_ids)
        self.dead_lettered += len(dead)
        if dead:
            self.metrics.dead_letters.inc(len(dead))
            logger.warning("%s: dead-lettered %d entries: %s", self.stage.group, len(dead),
                           "; ".join(str(d["reason"]) for d in dead[:3]))  # fmt: skip

    def touch(self, entry_ids: list[bytes]) -> None:
        # The jobs of one bundle entry share its id: each id once.
        touch(self.client, self.stream, self.stage.group, self.consumer,
              list(dict.fromkeys(entry_ids)))  # fmt: skip

    def _claim_stale(self) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
        """Take over entries idle past claim_idle_ms; dead-letter the over-delivered ones and
        split the bundles delivered more than once (`_split_bundles`)."""
        self._next_claim = time.monotonic() + self.config.claim_idle_ms / 2000
        self._claim_cursor, claimed, _ = self.client.xautoclaim(
            self.stream, self.stage.group, self.consumer,
            min_idle_time=self.config.claim_idle_ms, start_id=self._claim_cursor,
            count=self.config.read_count,
        )  # fmt: skip
        if not claimed:
            return []
        keep, dead, answers, bundles = [], [], [], []
        for entry_id, fields in claimed:
            info = self.client.xpending_range(
                self.stream, self.stage.group, min=entry_id, max=entry_id, count=1
            )
            deliveries = info[0]["times_delivered"] if info else 1
            payloads = _bundled(fields)
            if payloads is not None and deliveries >= 2:
                bundles.append((entry_id, payloads))
            elif deliveries > self.config.max_deliveries:
                payload = (fields or {}).get(ENTRY_FIELD, (fields or {}).get(JOBS_FIELD))
                reason = f"delivered {deliveries} times without being handled"
                dead.append((entry_id, dead_letter_fields(self.stream, entry_id, reason, payload)))
                answers.append(self._poison_reply(payload, deliveries))
            else:
                keep.append((entry_id, fields))
        if dead:
            outputs = [answer for answer in answers if answer is not None]
            self._commit([entry_id for entry_id, _ in dead], outputs, [d for _, d in dead])
        if bundles:
            self._split_bundles(bundles)
        self.metrics.claimed.inc(len(claimed))
        logger.info("%s: claimed %d stale entries", self.stage.group, len(keep))
        return keep

    def _split_bundles(self, bundles: list[tuple[bytes, list[bytes]]]) -> None:
        """Put each job of these bundles back on the stream as an entry of its own and
        acknowledge the bundles, in one MULTI: a bundle that came back is one that a consumer
        died holding, and as single entries each job counts its own deliveries, so a job that
        kills its consumers is dead-lettered alone rather than take its bundle-mates along."""
        pipe = self.client.pipeline(transaction=True)
        for _, payloads in bundles:
            for payload in payloads:
                pipe.xadd(self.stream, {ENTRY_FIELD: payload})
        pipe.xack(self.stream, self.stage.group, *[entry_id for entry_id, _ in bundles])
        execute_logging_errors(pipe, self.stage.group)
        logger.warning("%s: split %d bundles delivered more than once into %d entries",
                       self.stage.group, len(bundles),
                       sum(len(payloads) for _, payloads in bundles))  # fmt: skip

    def _poison_reply(self, payload: bytes | None, deliveries: int) -> Outbound | None:
        """The error reply for a request whose entry kept its consumers from finishing it."""
        try:
            address = requester(decode(payload, *self.stage.accepts))
        except ProtocolError as exc:
            answer = malformed_reply(payload, exc)
            return None if answer is None else reply(self.config, *answer)
        if address is None:
            return None
        rid, reply_to = address
        return reply(self.config, reply_to, too_many_deliveries(rid, deliveries))


def _bundled(fields: dict[bytes, bytes] | None) -> list[bytes] | None:
    """The job payloads of a well-formed bundle entry; None for any other entry (a malformed
    bundle is dead-lettered whole when it is processed)."""
    if not fields or JOBS_FIELD not in fields:
        return None
    try:
        return bundle_payloads(fields)
    except ProtocolError:
        return None


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


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT end the loop after the batch in hand (main thread only)."""

    def handler(signum: int, _frame: Any) -> None:
        logger.info("signal %d: stopping after the current batch", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
