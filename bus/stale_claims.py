"""Taking over what a dead consumer left pending, for a stage's `Actor` (bus/actor.py).

Entries left pending by a dead consumer are taken over with ``XAUTOCLAIM`` once idle for
``claim_idle_ms``, on the stage's own stream and, each in turn, on one of its extra inputs
(bus/extra_inputs.py). One delivered more than ``max_deliveries`` times is dead-lettered (it
may be what killed its consumers), with an error reply to its requester. A bundle of jobs
(jobs/wire.py) claimed after a delivery is split into single-job entries first, so one poison
job cannot take its bundle-mates down.
"""

from __future__ import annotations

import logging
import time

import redis

from bus.effects import Outbound, dead_letter_fields, execute_logging_errors, reply
from bus.reconnect import is_missing_group
from jobs.job_failures import malformed_reply, too_many_deliveries
from jobs.protocol import (
    ENTRY_FIELD,
    JOBS_FIELD,
    Message,
    ProtocolError,
    bundle_payloads,
    decode,
)

logger = logging.getLogger("bus.actor")

Entry = tuple[bytes, dict[bytes, bytes] | None]  # (entry id, fields; None once deleted)
Read = list[tuple[str, list[Entry]]]  # entries, by the stream they were read from


def requester(message: Message) -> tuple[str, str] | None:
    """(rid, reply_to) of a message that says who is waiting for it."""
    rid, reply_to = getattr(message, "rid", None), getattr(message, "reply_to", None)
    if not isinstance(rid, str) or not isinstance(reply_to, str):
        return None
    return rid, reply_to


class StaleClaims:
    """The claims of an `Actor` (its client, config, stage, consumer, streams and commit)."""

    def _claim_stale(self) -> Read:
        """Take over entries idle past claim_idle_ms, on our stream and on one extra input
        (each in turn); dead-letter the over-delivered ones and split the bundles delivered
        more than once (`_split_bundles`)."""
        self._next_claim = time.monotonic() + self.config.claim_idle_ms / 2000
        extra = self.extra.next_to_claim()
        reads = [(stream, self._claim_on(stream)) for stream in (self.stream, extra) if stream]
        return [(stream, keep) for stream, keep in reads if keep]

    def _claim_on(self, stream: str) -> list[Entry]:
        try:
            cursor, claimed, _ = self.client.xautoclaim(
                stream, self.stage.group, self.consumer,
                min_idle_time=self.config.claim_idle_ms,
                start_id=self._claim_cursors.get(stream, "0-0"), count=self.config.read_count,
            )  # fmt: skip
        except redis.ResponseError as exc:
            if stream == self.stream or not is_missing_group(exc):
                raise
            self.extra.lost()  # an extra input is gone (a dead worker's log, read through)
            return []
        self._claim_cursors[stream] = cursor
        if not claimed:
            return []
        keep, dead, answers, bundles = [], [], [], []
        for entry_id, fields in claimed:
            info = self.client.xpending_range(
                stream, self.stage.group, min=entry_id, max=entry_id, count=1
            )
            deliveries = info[0]["times_delivered"] if info else 1
            payloads = _bundled(fields) if stream == self.stream else None
            if payloads is not None and deliveries >= 2:
                bundles.append((entry_id, payloads))
            elif deliveries > self.config.max_deliveries:
                field = ENTRY_FIELD if stream == self.stream else self._extra_field
                payload = (fields or {}).get(field, (fields or {}).get(JOBS_FIELD))
                reason = f"delivered {deliveries} times without being handled"
                dead.append((entry_id, dead_letter_fields(stream, entry_id, reason, payload)))
                answers.append(self._poison_reply(payload, deliveries))
            else:
                keep.append((entry_id, fields))
        if dead:
            outputs = [answer for answer in answers if answer is not None]
            self._commit({stream: [entry_id for entry_id, _ in dead]}, outputs,
                         [d for _, d in dead])  # fmt: skip
        if bundles:
            self._split_bundles(bundles)
        self.metrics.claimed.inc(len(claimed))
        logger.info("%s: claimed %d stale entries on %s", self.stage.group, len(keep), stream)
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
