"""How a worker admits what it reads off its stream: each job started in the engine, or
refused, set aside or dropped with its reason, and each Abort acted on.

A mixin of the Worker (gpu_worker/worker.py), whose state it uses: what one job's content
raises at admission is that job's error reply (jobs/job_failures.py), never the worker's; a
job that failed on ``max_deliveries`` workers is set aside (dead-lettered, with an error
reply); a job aborted on its way is dropped on arrival (bus/aborts.py); one handed back whose
log says it ended is only acknowledged. Every end goes through `JobEnds` (job_ends.py): an
entry may hold a router batch's bundle of jobs, acknowledged once the last of them ends.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from bus.effects import dead_letter_fields, reply
from bus.fenced_stream import Entry, FencedStream
from gpu_worker.grammar_waits import GrammarWaits, Waiting
from gpu_worker.job_ends import JobEnds
from gpu_worker.probation import Probation
from gpu_worker.publishing import Publisher
from gpu_worker.scheduling.req import Req
from gpu_worker.token_item import RunningJob, stop_window
from gpu_worker.worker_metrics import WorkerMetrics
from jobs.job_failures import failure_reply, malformed_reply, too_many_deliveries
from jobs.protocol import (
    JOBS_FIELD,
    Abort,
    ErrorReply,
    ProtocolError,
    TokenizedRequest,
    decode,
    job_payloads,
)
from jobs.request_bounds import request_bounds
from runtime.config import BusConfig

# A job's age at its admission counts up to this (a clock skewed between hosts cannot put
# a fresh job ahead of everything for longer).
ARRIVAL_AGE_CAP_S = 60.0

if TYPE_CHECKING:
    import redis

    from gpu_worker.engine import Engine

logger = logging.getLogger(__name__)


class JobAdmission:
    # The Worker's, set in its __init__.
    engine: Engine
    scheduler: object
    client: redis.Redis
    config: BusConfig
    worker_id: str
    bus: FencedStream
    ends: JobEnds
    publisher: Publisher
    metrics: WorkerMetrics
    probation: Probation[Req]
    grammar_waits: GrammarWaits
    jobs: dict[str, RunningJob]
    admitted: int
    steps: int

    def _admit(self, entries: list[Entry]) -> None:
        try:
            self._admit_jobs(entries)
        finally:
            self.publisher.admitted(entries)

    def _admit_jobs(self, entries: list[Entry]) -> None:
        jobs: list[tuple[bytes, TokenizedRequest]] = []
        for entry_id, fields in entries:
            if fields is None:  # deleted by hand while pending (the bus never trims those)
                self._set_aside(entry_id, None, "deleted from the stream while pending", None)
                continue
            try:  # one job, or a router batch's bundle (jobs/wire.py): refused whole if malformed
                payloads = job_payloads(fields)
            except ProtocolError as exc:
                self._set_aside(entry_id, fields.get(JOBS_FIELD), str(exc), None)
                continue
            self.ends.admitted(entry_id, len(payloads))
            for payload in payloads:
                try:
                    message = decode(payload, TokenizedRequest, Abort)
                except ProtocolError as exc:
                    self._set_aside(entry_id, payload, str(exc), malformed_reply(payload, exc))
                    continue
                if isinstance(message, Abort):
                    self._abort(message.rid, entry_id)
                    continue
                failures = self._failures(entry_id, message)
                if failures >= self.config.max_deliveries:
                    answer = (message.reply_to, too_many_deliveries(message.rid, failures))
                    self._set_aside(entry_id, payload, f"failed {failures} times", answer)
                else:
                    jobs.append((entry_id, message))
        self.admitted += len(jobs)
        if not jobs:
            return
        # A job aborted while on its way here is dropped on arrival (see bus/aborts.py); one
        # with progress was begun by a worker that died, and continues after it; one whose
        # progress is None ended here, and only its acknowledgement was not written.
        aborted = self.client.mget([self.config.abort_key(job.rid) for _, job in jobs])
        progress = self.publisher.progress(jobs)
        for (entry_id, job), abort_flag in zip(jobs, aborted, strict=True):
            if (generated := progress[job.rid]) is None or abort_flag is not None:
                self.ends.ended(entry_id, job.rid)
                if generated is not None:
                    self.publisher.publish_aborted(job, generated, self.steps)
            else:
                self._start(entry_id, job, generated)

    def _failures(self, entry_id: bytes, job: TokenizedRequest) -> int:
        """How often a worker failed on this job: died holding it (the reaper's count, then a
        previous life's under this id) or raised in a step while it was in the engine."""
        died = (job.attempts or 0) + self.bus.previous_deliveries.get(entry_id, 0)
        return died + self.probation.strikes.get(job.rid, 0)

    def _set_aside(
        self, entry_id: bytes, payload: bytes | None, reason: str,
        answer: tuple[str, ErrorReply] | None,
    ) -> None:  # fmt: skip
        """Acknowledge an entry that will not run, dead-letter it, and answer its requester."""
        logger.warning("worker %s: setting %s aside: %s", self.worker_id, entry_id, reason)
        self.ends.ended(entry_id, answer[1].rid if answer is not None else None)
        self.bus.dead.append(dead_letter_fields(self.bus.stream, entry_id, reason, payload))
        if answer is not None:
            self.probation.forget(answer[1].rid)
            self.bus.outbox.append(reply(self.config, *answer))

    def _start(
        self, entry_id: bytes, job: TokenizedRequest, generated: list[int],
        compiled: bool = False,
    ) -> None:  # fmt: skip
        if job.rid in self.jobs or job.rid in self.grammar_waits:
            logger.warning("worker %s: duplicate job %s ignored", self.worker_id, job.rid)
            self.ends.ended(entry_id, None)  # not its rid: that job runs on
            return
        try:
            # The request normaliser's defaults (OpenAI's missing max_tokens: all that fit).
            params = self.engine.sampling_params(job.sampling, len(job.input_ids))
            compiling = None if compiled else self.engine.grammars.compile_soon(params)
            if compiling is not None:  # admitted once compiled, by `_turn`
                deadline = time.monotonic() + request_bounds().grammar_compile_timeout_s
                self.grammar_waits.park(Waiting(entry_id, job, generated, *compiling, deadline))
                return
            req = self.engine.build_request(job.rid, job.input_ids, params, detokenize=False,
                                            output_ids=generated, pooling=job.pooling)  # fmt: skip
            req.tenant = job.tenant or ""
            req.weight = job.weight or 1.0
            req.priority = job.priority or 0  # the job's, beside its sampling
            if job.created is not None:  # spf ages it from its arrival, not from here
                req.arrived -= min(max(time.time() - job.created, 0.0), ARRIVAL_AGE_CAP_S)
        except Exception as exc:  # whatever one job's content raises is its own error
            self._refuse(entry_id, job, exc)
            return
        window = stop_window(params.stop)
        running = RunningJob(req, job.reply_to, entry_id, window, reported=len(generated),
                             created=None if generated else job.created, tag=job.tag,
                             reply_version=job.v, bundle=bool(job.bundle_replies),
                             text_only=bool(job.text_only))  # fmt: skip
        self.jobs[job.rid] = running
        if generated:
            self.metrics.migrated_in.inc()
            logger.info("worker %s: resuming %s after %d tokens", self.worker_id, job.rid,
                        len(generated))  # fmt: skip
        if not self.probation.hold(job.rid, req):
            self.scheduler.add_request(req)

    def _refuse(self, entry_id: bytes, job: TokenizedRequest, exc: Exception) -> None:
        """Acknowledge a job that will not run, with the error reply for what it raised."""
        self.ends.ended(entry_id, job.rid)
        self.probation.forget(job.rid)
        answer = failure_reply(job.rid, exc, f"worker {self.worker_id}", checking=True)
        if answer.status >= 500:
            logger.exception("worker %s: admitting %s failed", self.worker_id, job.rid)
            payload = f"{type(exc).__name__}: {exc}"[:1000]
            self.bus.dead.append(dead_letter_fields(self.bus.stream, entry_id, payload, None))
        self.bus.outbox.append(reply(self.config, job.reply_to, answer))

    def _abort(self, rid: str, entry_id: bytes | None = None) -> None:
        if entry_id is not None:  # an Abort entry (of no job: its rid is the aborted one's)
            self.ends.ended(entry_id, None)
        waiting = self.grammar_waits.pop(rid)
        if waiting is not None:  # never reached the engine
            self.ends.ended(waiting.entry_id, rid)
            self.publisher.publish_aborted(waiting.job, waiting.progress, self.steps)
            return
        held = self.probation.forget(rid)
        if held is not None:  # never reached the engine: end it as the engine would have
            self.scheduler.add_request(held)
        req = self.scheduler.abort_request(rid)
        if req is not None and rid in self.jobs:
            self.publisher.publish_items([self.publisher.item(self.jobs[rid])], self.steps)
