"""The router stage: each token-id job goes to a live worker, by the prefix its prefix cache
would reuse against its load (stages/router/kv_routing.py; ``router_policy = "load"``: the
least-loaded live worker).

Stateless across replicas: the live workers and their load come from Redis on every batch
(bus/liveness.py: the workers' heartbeats and the jobs every router replica has routed to
each worker, ``<p>:routed``, in one pipelined read; the workers set naming them is read
again each second), so jobs routed since a worker's last heartbeat count against it and a
burst is spread instead of piling onto the worker that looked idlest a second ago. Where a
job went is not recorded per job (an abort is a flag its worker reads: bus/aborts.py). With
no live worker the batch is held (unacknowledged) until one appears, and failed with a 503
reply after ``no_worker_timeout_s``.

A heartbeat is up to ``heartbeat_interval_s`` old: it would show a worker that just finished
a conversation's turn still running it, and send the next turn elsewhere. So with
``router_policy = "kv"`` the load a worker wrote with its last kv-events entry (a worker with
a prefix cache writes one after every finish, jobs/kv_events.py) stands in for its
heartbeat's when it is the newer, and the jobs in transit to it are those routed past that
figure's admitted count.

What the workers' caches hold comes from the ``kv-events`` stream, read into an index before
each batch (stages/router/kv_index.py; a router started anew reads it from the start). Within
a batch each routed job counts at once as one more job on its worker and its blocks as held
there, so the batch routes as a run of one-job batches would: a cold burst's jobs of one
prefix follow its first job, and those of other prefixes spread. Why each job went where it
did, and the cached tokens expected there, travel with the job (its ``route_reason`` and
``expected_cached``, which the worker reports in its Finish) and are counted in the router's
metrics (stages/router/router_metrics.py).

A batch's jobs for one worker go in one bundle entry on its stream when its heartbeat says it
reads bundles (``reads_bundles``; older workers get an entry per job): one XADD per worker per
batch, where an XADD per job was the largest per-request cost left on the bus (issue 27).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis

from bus.actor import HoldBatch, Inbound
from bus.effects import IncrHash, Outbound, Output, reply
from bus.liveness import RegisteredWorkers, read_liveness
from jobs.kv_blocks import block_hashes
from jobs.kv_events import LoadReading
from jobs.protocol import ErrorReply, Heartbeat, TokenizedRequest
from observability.metrics import ProcessMetrics
from runtime.config import BusConfig
from stages.router.kv_index import KvIndex
from stages.router.kv_routing import choose
from stages.router.router_metrics import RouterMetrics

logger = logging.getLogger(__name__)

NO_WORKER_POLL_S = 0.2


@dataclass
class WorkerLoad:
    worker_id: str
    stream: str
    queued: int  # running + waiting + routed but not yet read by the worker
    free_kv_tokens: int
    routed: int = 0  # jobs routed to it since it started, by every router replica
    reads_bundles: bool = False  # a batch's jobs for it go in one entry (bus/effects.py)


def newest_load(beat: Heartbeat, reading: LoadReading | None) -> LoadReading:
    """The newer of a worker's heartbeat and the load it last wrote on the kv-events stream
    (one clock, the worker's, stamps both)."""
    if reading is not None and reading.time > beat.time:
        return reading
    return LoadReading(beat.running, beat.waiting, beat.free_kv_tokens, beat.admitted,
                       beat.time)  # fmt: skip


def live_workers(
    client: redis.Redis, config: BusConfig, readings: Mapping[str, LoadReading] | None = None,
    registered: RegisteredWorkers | None = None,
) -> list[WorkerLoad]:  # fmt: skip
    """Workers whose heartbeat key is alive and readable (the reaper,
    stages/router/worker_reaper.py, moves the jobs of the lapsed ones and removes their ids),
    each with the newer of its heartbeat's load and its entry in `readings` (KvIndex.loads);
    the workers set as `registered` keeps it, where given."""
    liveness = read_liveness(client, config, routed=True, registered=registered)
    for worker_id, why in liveness.malformed.items():
        logger.warning("ignoring worker %s: malformed heartbeat (%s)", worker_id, why)
    loads = []
    for worker_id, beat in liveness.beats.items():
        load = newest_load(beat, (readings or {}).get(worker_id))
        # Routed, not yet read by the worker when `load` was taken.
        in_transit = max(0, liveness.routed.get(worker_id, 0) - load.admitted)
        queued = load.running + load.waiting + in_transit
        loads.append(WorkerLoad(worker_id, beat.stream, queued, load.free_kv_tokens,
                                liveness.routed.get(worker_id, 0),
                                bool(beat.reads_bundles)))  # fmt: skip
    return loads


class RouterStage:
    group = "router"
    accepts = (TokenizedRequest,)

    def __init__(self, config: BusConfig, client: redis.Redis, stop: threading.Event) -> None:
        self.config = config
        self.client = client
        self.stop = stop
        # Set by the Actor to its touch(): while this holds a batch, no replica may claim it.
        self.keep_alive: Callable[[list[bytes]], None] = lambda entry_ids: None
        self.index = KvIndex(client, config) if config.router_policy == "kv" else None
        # The workers set, read again each second: the heartbeats, read every batch, say
        # which of its workers are alive (bus/liveness.py).
        self.registered = RegisteredWorkers()
        self.metrics = RouterMetrics(ProcessMetrics("router", "router", enabled=False))

    def use_metrics(self, process: ProcessMetrics) -> None:
        """Count decisions in the replica's metrics (the Actor's, published to Redis)."""
        self.metrics = RouterMetrics(process)

    def input_stream(self, config: BusConfig) -> str:
        return config.tokenized_stream()

    def handle(self, batch: list[Inbound]) -> list[Output]:
        jobs = [inbound.message for inbound in batch]
        if self.index is not None:  # before the liveness read: its loads may be the newer
            self.index.refresh()
        workers = self._wait_for_workers([inbound.entry_id for inbound in batch])
        if not workers:
            return [
                reply(self.config, job.reply_to, ErrorReply(
                    job.rid, 503,
                    f"no live worker for {self.config.no_worker_timeout_s:g} s; try again later",
                    "service_unavailable", None, "no_worker",
                ))
                for job in jobs
            ]  # fmt: skip
        if self.index is not None:
            self.index.keep_only(worker.worker_id for worker in workers)
        outputs: list[Output] = []
        routed: dict[str, int] = {}
        # The lower priority classes first, to the least loaded workers (a stable sort:
        # arrival order within a class).
        for job in sorted(jobs, key=lambda job: job.priority or 0):
            # A job moved off a dead worker continues after its progress: that is prompt too.
            ids = job.input_ids + list(job.progress or ())
            hashes = block_hashes(ids, self.config.kv_block_tokens) if self.index else []
            choice = choose(workers, hashes, len(ids), self.index, self.config)
            worker = choice.worker
            # The next jobs, of this batch too, see it one job busier and holding the blocks.
            worker.queued += 1
            worker.routed += 1
            if self.index is not None:
                self.index.expect(worker.worker_id, hashes)
            self.metrics.decided(choice, len(ids))
            job.route_reason, job.expected_cached = choice.reason, choice.expected_cached
            outputs.append(Outbound(worker.stream, job, bundle=worker.reads_bundles))
            routed[worker.worker_id] = routed.get(worker.worker_id, 0) + 1
        # One count per worker per batch, not one per job.
        outputs += [IncrHash(self.config.routed_key(), w, n) for w, n in routed.items()]
        return outputs

    def _wait_for_workers(self, entry_ids: list[bytes]) -> list[WorkerLoad]:
        deadline = time.monotonic() + self.config.no_worker_timeout_s
        touch_every = self.config.claim_idle_ms / 2000
        next_touch = time.monotonic() + touch_every
        warned = False
        while True:
            loads = self.index.loads if self.index is not None else None
            workers = live_workers(self.client, self.config, loads, self.registered)
            if workers or time.monotonic() >= deadline:
                return workers
            if self.stop.is_set():
                raise HoldBatch  # another replica (or this one, restarted) routes them
            if time.monotonic() >= next_touch:
                self.keep_alive(entry_ids)
                next_touch = time.monotonic() + touch_every
            if not warned:
                logger.warning("no live worker: holding jobs for up to %g s",
                               self.config.no_worker_timeout_s)  # fmt: skip
                warned = True
            # Wake for the next touch too: sleeping a whole poll past it with a short
            # claim_idle_ms would let another replica claim the batch and route it twice.
            self.stop.wait(max(0.0, min(NO_WORKER_POLL_S, next_touch - time.monotonic())))
