"""The worker stage: the engine loop with the bus around it.

    python -m gpu_worker --redis-url unix:///tmp/redis.sock --model smollm2-135m-instruct

The loop is the engine's (receive, schedule, forward, sample, process results) with Redis at
its two ends. Jobs arrive on this worker's own stream ``<p>:worker:<id>``, a router batch's
in one entry (their ends: gpu_worker/job_ends.py), read by a thread of their own
(gpu_worker/job_intake.py: a command per arrival, not per publish). While there is work the
worker publishes at most every ``publish_interval_ms`` (gpu_worker/publishing.py): an entry
of its progress log with a TokenBatch of every request's tokens since the last publish, in a
commit that may also carry the acknowledgements of ended jobs (bus/fenced_stream.py says
when) and, at most every ``abort_check_interval_ms``, a read of its jobs' aborts
(bus/aborts.py): one round trip a publish, whatever the batch size and however many steps it
covers. The heartbeat has a thread of its own (gpu_worker/heartbeat.py), so a long step
never makes a live worker look dead. Forming batches stays here: a round trip per step would
cost more.

The worker does not detokenize: requests with stop strings keep a TextStream to find them,
the rest leave text to the detokenizer (stages/detokenizer/incremental.py), with a window.

Nothing is lost when a worker dies, and a worker taken for dead while alive writes nothing
more about the jobs claimed off it: the rules, and the stream and fence that keep them, are
in bus/fenced_stream.py.

A job's content never ends the worker (jobs/job_failures.py). Whatever admitting one job
raises is that job's error reply. A step that raises (the job that caused it cannot be told
apart) leaves no trace: the scheduler drops every request and its KV, every job is admitted
again from its progress log, those of the failed batch with a strike, and the struck
ones go back into the engine one at a time (gpu_worker/probation.py). A job the worker failed
on ``max_deliveries`` times, or whose workers died holding it as often (its ``attempts``, and
the deliveries of a previous life under this id), is set aside: dead-lettered, with an error
reply.

New weights (gpu_worker/weights_update.py): admit nothing, let what runs finish, swap, resume.
Jobs become engine requests in job_admission.py, their tokens items in publishing.py; the CLI
is cli.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from bus.fenced_stream import Entry, Fenced, FencedStream
from bus.reconnect import ReconnectingLoop
from gpu_worker.grammar_waits import GrammarWaits
from gpu_worker.heartbeat import HeartbeatThread, Load
from gpu_worker.job_admission import JobAdmission
from gpu_worker.job_intake import JobIntake
from gpu_worker.probation import Probation
from gpu_worker.publishing import Publisher
from gpu_worker.scheduling.req import Req
from gpu_worker.token_item import RunningJob
from gpu_worker.weights_update import WeightsUpdates, split_aborts
from gpu_worker.worker_metrics import WorkerMetrics
from jobs.weights import initial_version
from observability.metrics import ProcessMetrics, start_publisher
from runtime.config import BusConfig

if TYPE_CHECKING:  # or a SyntheticEngine (gpu_worker/synthetic_engine.py), without torch
    from gpu_worker.engine import Engine

logger = logging.getLogger(__name__)


class Worker(JobAdmission):
    def __init__(
        self, engine: Engine, client: redis.Redis, config: BusConfig, worker_id: str, model: str,
        weights: WeightsUpdates | None = None,  # default: `model`'s, with no update yet
    ) -> None:  # fmt: skip
        self.engine = engine
        self.scheduler = engine.scheduler
        self.client = client
        self.config = config
        self.worker_id = worker_id
        self.model = model
        self.bus = FencedStream(client, config, worker_id)
        self.stop = threading.Event()
        self.intake = JobIntake(self.bus, self.stop)  # started by `run`; else commits read
        self.jobs: dict[str, RunningJob] = {}
        self.admitted = 0
        self.steps = 0
        self.bus_seconds = 0.0  # time spent on Redis while there was work: the bus's cost
        self._inbox: list[Entry] = []  # read, not yet admitted
        # The jobs that were in a step that raised (gpu_worker/probation.py).
        self.probation: Probation[Req] = Probation()
        self.grammar_waits = GrammarWaits()  # jobs whose grammar compiles off this thread
        self.weights = weights or WeightsUpdates(worker_id, initial_version(model))
        self.heartbeat = HeartbeatThread(
            client, config, worker_id, self.bus.stream, model, engine.runner.max_total_tokens,
            attention=engine.runner.serving_path(), weights=self.weights,
        )  # fmt: skip
        runner = engine.runner
        self.metrics = WorkerMetrics(ProcessMetrics("worker", worker_id, config.metrics),
                                     runner.max_total_tokens)  # fmt: skip
        self.metrics.describe(model, runner.attention_path, runner.graph_runner is not None,
                              runner.cpu_kernels is not None)  # fmt: skip
        self.publisher = Publisher(client, config, worker_id, self.bus, self.metrics,
                                   self._finished, self.scheduler, self.weights)  # fmt: skip
        self.ends = self.publisher.ends  # gpu_worker/job_ends.py
        self._publisher = None

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        # `admitted` counts from 0 again: so must the jobs routed to this id, or a restarted
        # worker would look busy with its previous life's jobs.
        self.client.hdel(self.config.routed_key(), self.worker_id)
        # Jobs a previous life under this id left pending: resumed here, from their progress.
        self._inbox = self.publisher.handed_back(self.bus.open())
        self._report_load()
        self.heartbeat.beat()  # the routers can route to us now
        self.heartbeat.start()
        self.intake.start()
        self._publisher = start_publisher(self.client, self.config, self.metrics.process)
        logger.info("worker %s: consumer %s on %s, %s in %s on %s", self.worker_id,
                    self.bus.consumer, self.bus.stream, self.engine.config.model,
                    self.engine.runner.dtype, self.engine.runner.device)  # fmt: skip
        # Through an outage, outputs not yet written stay in the outbox for the next commit.
        loop = ReconnectingLoop(f"worker {self.worker_id}", self.stop, self.bus.ensure_group,
                                on_retry=self._report_load)  # fmt: skip
        try:
            loop.run(self._turn, group_made=True)
        finally:
            self._shutdown()

    def _turn(self) -> None:
        """Admit what arrived, then step and commit, or, idle, commit and wait for jobs. New
        weights due: admit only aborts, step until nothing runs, swap."""
        update = self.weights.due()
        for waiting, too_late in self.grammar_waits.due() if update is None else ():
            if too_late is not None:
                self._refuse(waiting.entry_id, waiting.job, too_late)
            else:
                self._start(waiting.entry_id, waiting.job, waiting.progress, compiled=True)
        if self._inbox and update is None:
            self._admit(self._inbox)
            self._inbox = []
        elif self._inbox:  # draining for new weights: aborts act now, jobs wait, pending
            aborts, self._inbox = split_aborts(self._inbox)
            for entry_id, rid in aborts:
                self._abort(rid, entry_id)
        released = self.probation.release()
        if released is not None:
            self.scheduler.add_request(released)
        if self.scheduler.has_work():
            again = self._step_or_recover()
            if again or self.publisher.due(self.scheduler.has_work()):
                started = time.perf_counter()
                self._inbox += again + self._commit(read=not self.intake.running)
                self.bus_seconds += time.perf_counter() - started
            self._inbox += self.intake.take()
        else:
            self._inbox += self._commit(read=False)  # fenced: all still ours
            if update is None:
                self._inbox += self.intake.wait()
            elif not self.jobs:  # drained (a job on probation is not: it is released next)
                self.weights.apply(self.engine, update)  # on failure, serves on: never raises
        self._report_load()

    def _commit(self, read: bool) -> list[Entry]:
        """Publish what was generated and queued since the last publish, and the load (told
        the heartbeat first: heartbeat.py), in one commit (fenced_stream.py); the jobs read."""
        self.publisher.publish(self.jobs, self.steps, self._report_load(),
                               self.grammar_waits.rids())  # fmt: skip
        try:
            jobs = self.bus.commit(read)
        except Fenced:
            self.publisher.committed(False)
            return self._restart_fenced()
        self.publisher.committed(True)
        for rid in self.bus.take_flagged():  # aborted since the last check: bus/aborts.py
            self._abort(rid)
        return jobs

    def _restart_fenced(self) -> list[Entry]:
        """The reaper took jobs off us. Drop every job and what was not yet written of them,
        and return the entries still pending to us: those are ours, to admit again, each
        resuming after its progress."""
        logger.warning("worker %s: taken for dead, jobs were claimed off it; dropping %d "
                       "jobs and resuming those still its own", self.worker_id,
                       len(self.jobs))  # fmt: skip
        for rid in list(self.jobs):
            self.scheduler.abort_request(rid)
        self.jobs.clear()
        self.publisher.dropped()
        self.probation.clear()
        self.grammar_waits.clear()
        self._inbox.clear()  # in place: read again with all still ours (`_turn` extends it)
        with self.intake.paused():
            return self.publisher.handed_back(self.bus.restart_fenced())

    def _report_load(self) -> Load:
        load = Load(**self.scheduler.load(), admitted=self.admitted)
        self.heartbeat.report(load)
        self.metrics.load(load.running, load.waiting, load.free_kv_tokens,
                          self.scheduler.num_retractions)  # fmt: skip
        return load

    # ---- results out ---------------------------------------------------------------------

    def _step_or_recover(self) -> list[Entry]:
        """One step; if it raises, start the engine's state afresh and return every job's
        entry, to admit again from its progress (the module docstring says why)."""
        written = self.bus.queued()
        try:
            self._step()
            return []
        except Exception:
            logger.exception("worker %s: a step failed with %d jobs in the engine; admitting "
                             "them again", self.worker_id, len(self.jobs))  # fmt: skip
            self.bus.drop_since(written)  # what it queued describes a state now dropped
            stepping = self.scheduler.stepping
            self.probation.strike(self.jobs if stepping is None else stepping)
            self.jobs.clear()
            self.publisher.dropped()  # what was not published is generated again
            self.grammar_waits.clear()  # their entries are read again with the others
            self._inbox.clear()  # and so are these
            self.scheduler.reset()
            self.metrics.step_failures.inc()
            return self.publisher.handed_back(self.bus.pending_entries())

    def _step(self) -> None:
        began, started = time.time(), time.perf_counter()
        sampled = self.scheduler.step()
        if sampled is None:
            # Admission checks that every request fits the pool alone; this is a bug.
            raise RuntimeError(f"scheduler has nothing to run: {self.scheduler.load()}")
        self.metrics.step(self.scheduler.last_mode, time.perf_counter() - started)
        self.steps += 1
        for req in sampled:
            job = self.jobs.get(req.rid)
            if job is None:
                continue
            self.publisher.gained(req.rid)
            self.probation.passed(req.rid)
            if job.created is not None and job.queue_seconds is None:
                job.queue_seconds = max(0.0, began - job.created)
                self.metrics.queue_time.observe(job.queue_seconds)

    def _finished(self, job: RunningJob) -> None:
        """Its last item is queued, marking it ended on the log: its ack may wait (`ack_later`)."""
        self.probation.forget(job.req.rid)
        self.ends.ended(job.entry_id, job.req.rid)
        del self.jobs[job.req.rid]

    def _shutdown(self) -> None:
        """Publish what was generated and stop beating: the jobs still pending on our stream
        are the reaper's to move to live workers, which continue them after their progress."""
        self.stop.set()  # the intake's thread too, when the loop ended on an error
        try:
            self._commit(read=False)  # the tokens generated since the last publish
            for rid in list(self.jobs):
                self.scheduler.abort_request(rid)  # frees the KV; no finish is published
            self.jobs.clear()
            self._commit(read=False)
            self.heartbeat.goodbye()
            if self._publisher is not None:
                self._publisher.close()
        except redis.RedisError as exc:
            logger.warning("worker %s: could not say goodbye: %s", self.worker_id, exc)
        per_step_ms = 1000 * self.bus_seconds / max(self.steps, 1)
        logger.info("worker %s stopped after %d steps (%.3f ms of Redis per step)",
                    self.worker_id, self.steps, per_step_ms)  # fmt: skip


if __name__ == "__main__":  # this module was the worker's command once: say where it went
    raise SystemExit("python -m gpu_worker.worker is now python -m gpu_worker (streamserve worker)")
