"""What a busy worker publishes, and when: its jobs' new tokens, once per interval, and its
progress log.

Each publish costs the bus about six commands down the chain (docs/ARCHITECTURE.md),
whatever it carries, so a busy worker publishes at most every ``publish_interval_ms``, and
at once when its engine runs dry (a request's last tokens never wait): one entry of its
progress log holding one TokenBatch, with one item per request that gained tokens since the
last publish (all its steps' tokens), and the progress (jobs/progress.py) with the same ids
for every job at once (bus/fenced_stream.py: the detokenizers read the batch there). A
token waits at most the interval for its reader; at batch 64 a publish carries hundreds of
tokens.

Jobs handed back to the worker (a previous life's, or every job after the engine dropped its
state) find their progress in the worker's own log at admission (`progress`); the log is
not trimmed until they have (gpu_worker/progress_log.py).

The same publish carries, when the prefix cache changed, one `KvEvents` entry of the blocks
it stored and removed (gpu_worker/cached_blocks.py): what the routers route by. The entry
carries the worker's load as it stands after the steps published (the heartbeat's figures,
stamped with the time), and a worker with a prefix cache writes one with just the load when
a job finished but the cache did not change: the routers see a finished job leave the load
at once rather than at the next heartbeat, in an XADD the commit makes anyway.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import redis

from bus.effects import Outbound
from bus.fence_off import read_progress_log
from bus.fenced_stream import Entry, FencedStream
from gpu_worker.cached_blocks import watch_prefix_cache
from gpu_worker.heartbeat import Load
from gpu_worker.job_ends import JobEnds
from gpu_worker.progress_log import ProgressLog
from gpu_worker.token_item import RunningJob, aborted_item, finish_of, token_item
from gpu_worker.weights_update import WeightsUpdates
from gpu_worker.worker_metrics import WorkerMetrics
from jobs.kv_events import KvEvents
from jobs.progress import ended_jobs, rebuild
from jobs.protocol import TokenBatch, TokenItem, TokenizedRequest, encode
from runtime.config import BusConfig


class Publisher:
    def __init__(
        self, client: redis.Redis, config: BusConfig, worker_id: str, bus: FencedStream,
        metrics: WorkerMetrics, finished: Callable[[RunningJob], None], scheduler: object = None,
        weights: WeightsUpdates | None = None,
    ) -> None:  # fmt: skip
        self.client = client
        self.config = config
        self.worker_id = worker_id
        self.bus = bus
        self.metrics = metrics
        self.finished = finished  # the worker's: a job's last item is queued
        self.log = ProgressLog(worker_id, config.trim_interval_s)
        self.ends = JobEnds(bus, self.log)  # each job's end: marked on the log, then acked
        self._gained: dict[str, None] = {}  # rids with tokens not yet published, in order
        self._last = 0.0  # monotonic time of the last publish
        self._aborts_checked = time.monotonic()  # and of the last read of aborts
        self._finished_since = False  # a job finished since the last publish: the load fell
        self._taken_back: set[bytes] = set()  # entries whose progress is in our own log
        # rid -> why the router sent the job here and what it expected cached, for its Finish.
        self._routes: dict[str, tuple[str, int]] = {}
        # The weights serving (gpu_worker/weights_update.py), named in every Finish: a worker
        # swaps only with nothing running, so they computed the whole request.
        self.weights = weights
        # What the prefix cache holds (None: the engine has none, and publishes no events).
        self.blocks = watch_prefix_cache(scheduler, worker_id, config.kv_block_tokens,
                                         config.kv_snapshot_interval_s)  # fmt: skip

    # ---- when ----------------------------------------------------------------------------

    def gained(self, rid: str) -> None:
        """A step gave request `rid` tokens."""
        self._gained[rid] = None

    def due(self, has_work: bool) -> bool:
        """Publish now: the interval since the last publish is over, or the engine ran dry."""
        interval = self.config.publish_interval_ms / 1000
        return not has_work or time.monotonic() - self._last >= interval

    # ---- what ----------------------------------------------------------------------------

    def publish(self, jobs: dict[str, RunningJob], step: int, load: Load,
                waiting: list[str] | None = None) -> None:  # fmt: skip
        """Queue on the bus's next commit one item per request that gained tokens since the
        last publish, the progress log's entry for them, and the prefix cache's changes with
        `load` (already reported to the heartbeat: it is stamped after that); and, when due,
        a read of the aborts of `jobs` and of the jobs `waiting` outside the engine."""
        gained, self._gained = self._gained, {}
        if len(self._routes) > 2 * len(jobs) + 64:
            self._routes = {rid: route for rid, route in self._routes.items() if rid in jobs}
        self.publish_items([self.item(jobs[rid]) for rid in gained if rid in jobs], step)
        self.bus.ack_ended = not jobs  # ran dry: no later commit to wait for (fenced_stream.py)
        self.bus.progress = self.log.take()
        acked = self.ends.acked_with(self.bus.ack_ended)
        self.bus.progress_trim = self.log.trim_point(acked)
        self.bus.kv_events = self._kv_events(load)
        self._finished_since = False
        self._last = time.monotonic()
        held = [*jobs, *(waiting or ())]
        if held and self._last - self._aborts_checked >= self.config.abort_check_interval_ms / 1000:
            self.bus.abort_checks = held  # bus/aborts.py: read in this commit
            self._aborts_checked = self._last

    def _kv_events(self, load: Load) -> bytes | None:
        """The kv-events entry of this publish, stamped with `load`; None: nothing to say (or
        no prefix cache: such a worker's load is its heartbeat's alone)."""
        if self.blocks is None:
            return None
        events = self.blocks.take()
        if events is None and self._finished_since:
            events = KvEvents(self.worker_id)  # the load alone: the cache did not change
        if events is None:
            return None
        return encode(dataclasses.replace(events, **dataclasses.asdict(load), time=time.time()))

    def publish_items(self, items: list[TokenItem], step: int) -> None:
        if items:
            weights = self.weights.version if self.weights else None
            batch = TokenBatch(self.worker_id, step, items, weights=weights)
            self.bus.outbox.append(Outbound(self.config.tokens_stream(), batch))

    def item(self, job: RunningJob) -> TokenItem:
        """The job's item of the tokens it gained since its last one (with its finish, if it
        ended: then `finished` is told)."""
        req = job.req
        start, end = job.reported, len(req.output_ids)
        job.reported = end
        self.metrics.generation_tokens.inc(end - start)
        if end > start and not req.finished:
            # Logged in the commit that publishes these tokens, for all our jobs at once.
            self.log.log(req.rid, start, req.output_ids[start:end])
        item = token_item(req, job.reply_to, start, job.window, job.reply_version, job.bundle,
                          job.tag, job.text_only)  # fmt: skip
        if req.finished:
            self._finished_since = True
            item.finish = finish_of(req, job.queue_seconds)
            item.finish.weights_version = self.weights.version if self.weights else None
            route = self._routes.pop(req.rid, None)
            if route is not None:
                item.finish.route_reason, item.finish.expected_cached_tokens = route
                item.finish.worker = self.worker_id
            self.metrics.finished(item.finish)
            self.finished(job)
        return item

    def publish_aborted(self, job: TokenizedRequest, progress: list[int], step: int) -> None:
        """The last item of a job aborted on its way to the engine: its stream ends with
        "abort" (whoever aborted it may still be reading: POST /v1/abort, Client.abort)."""
        item = aborted_item(job, len(progress))
        self.metrics.finished(item.finish)
        self.publish_items([item], step)

    def committed(self, written: bool) -> None:
        """The bus's commit wrote what was queued (False: it was fenced, and wrote nothing)."""
        self.log.written(self.bus.progress_written if written else None)
        self.ends.committed(written)
        if not written and self.blocks is not None:
            self.blocks.resend()  # the changes were not written: say everything next time

    # ---- jobs handed back ----------------------------------------------------------------

    def dropped(self) -> None:
        """The worker dropped every job (fenced, or a step raised): what was not published is
        generated again; nothing is trimmed until the jobs are admitted again."""
        self._gained.clear()
        self.log.hold()
        self.ends.dropped()

    def handed_back(self, entries: list[Entry]) -> list[Entry]:
        """Entries handed to us again: their progress is read from our log at admission."""
        if entries:
            self._taken_back.update(entry_id for entry_id, _ in entries)
            self.log.hold()
        return entries

    def admitted(self, entries: list[Entry]) -> None:
        """These entries were read at admission (run, refused or set aside)."""
        self._taken_back.difference_update(entry_id for entry_id, _ in entries)
        if not self._taken_back:
            self.log.holding = False  # every job handed back is in hand again

    def _note_routes(self, jobs: list[TokenizedRequest]) -> None:
        """Keep each job's route figures for its Finish (`publish` drops those of jobs that
        never ran here: refused, or aborted on arrival)."""
        for job in jobs:
            if job.route_reason is not None:
                self._routes[job.rid] = (job.route_reason, job.expected_cached or 0)

    def progress(self, jobs: list[tuple[bytes, TokenizedRequest]]) -> dict[str, list[int] | None]:
        """Each job's published output: what it carries (from workers that died holding it),
        and for one handed back, what our own log holds beyond that. Those extra ids are
        logged again in our next publish, so our log may go below its older entries. None:
        the log says the job ended (only its acknowledgement was not written)."""
        carried: dict[str, list[int] | None] = {job.rid: list(job.progress or [])
                                                for _, job in jobs}  # fmt: skip
        self._note_routes([job for _, job in jobs])
        mine = [job.rid for entry_id, job in jobs if entry_id in self._taken_back]
        if not mine:
            return carried
        log = read_progress_log(self.client, self.config, self.worker_id)
        done = ended_jobs(log)
        rebuilt = rebuild(log, carried, [rid for rid in mine if rid not in done])
        carried.update(dict.fromkeys(done.intersection(mine)))
        for rid, ids in rebuilt.items():
            start = len(carried[rid])
            self.log.log(rid, start, ids[start:])
            carried[rid] = ids
        return carried
