"""The worker's heartbeat, beaten from its own thread.

A heartbeat written only between engine steps lapses whenever one step outlasts the TTL (a
long prefill on a CPU, a CUDA graph capture), and a live worker would be taken for dead and
its jobs moved. So a thread beats every interval whatever the engine is doing, with the
last load the main loop reported, for as long as that loop keeps turning. A loop that has
not turned for ``worker_stall_s`` is hung (a wedged GPU, a deadlock): the thread stops beating and
ends the process, so the reaper moves its jobs to live workers and the launcher (or the
container runtime) starts a fresh one. Nothing it held is lost: its jobs are still pending
on its stream, with their progress in Redis.

A beat that finds this worker gone from the workers set (the reaper forgot it while it was
alive) puts it back, and says so; what the reaper took off it, the worker learns from its
fence (bus/fenced_stream.py).

Each beat also reads the fleet's weights record (jobs/weights.py) in its round trip, for the
worker's `WeightsUpdates`, and announces the version the worker serves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from gpu_worker.weights_update import WeightsUpdates
from jobs.protocol import Heartbeat, encode
from jobs.weights import weights_key
from runtime.config import BusConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    """What the main loop reports each turn: its heartbeat's load fields (and its kv-events
    entries', jobs/kv_events.py)."""

    running: int
    waiting: int
    free_kv_tokens: int
    admitted: int


class HeartbeatThread(threading.Thread):
    def __init__(
        self,
        client: redis.Redis,
        config: BusConfig,
        worker_id: str,
        stream: str,
        model: str,
        max_total_tokens: int,
        on_stall: Callable[[], None] | None = None,
        attention: str | None = None,  # what serves attention, announced with the load
        weights: WeightsUpdates | None = None,  # the weights served, told of the fleet's record
    ) -> None:
        super().__init__(name=f"heartbeat-{worker_id}", daemon=True)
        self.client = client
        self.config = config
        self.worker_id = worker_id
        # What every beat says: who we are and serve, with the load and time of the beat.
        self._beat = Heartbeat(worker_id, stream, model, 0, 0, max_total_tokens,
                               max_total_tokens, 0, 0.0, attention,
                               reads_bundles=True)  # fmt: skip
        self.weights = weights
        self.on_stall = on_stall or _exit_hung
        self.load = Load(0, 0, max_total_tokens, 0)
        self.stop = threading.Event()
        self._turned_at = time.monotonic()
        self._registered = False  # in the workers set since our first beat

    def report(self, load: Load) -> None:
        """Called by the main loop each turn: the load to announce, and proof of life."""
        self.load = load
        self._turned_at = time.monotonic()

    def beat(self) -> None:
        # The time before the load: the worker's kv-events entries carry the load too, stamped
        # after it was reported here (gpu_worker/publishing.py), so an entry older than this
        # beat never holds a newer load than the beat does (the router keeps the newer).
        now = time.time()
        heartbeat = dataclasses.replace(self._beat, **dataclasses.asdict(self.load), time=now)
        weights = self.weights
        if weights is not None:
            heartbeat = dataclasses.replace(heartbeat, model=weights.source or heartbeat.model,
                                            weights_version=weights.version,
                                            weights_target=weights.target,
                                            weights_error=weights.error)  # fmt: skip
        # One round trip, no MULTI (SET, SADD and the weights record's HGETALL a beat per
        # worker, a fleet's background):
        # Redis runs them in order, so the beat exists before the membership that a reaper
        # reads with it, and a reaper that forgot this worker in between only makes the SADD
        # answer 1, which is warned about as any lapse is.
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.config.heartbeat_key(self.worker_id), encode(heartbeat),
                 px=int(self.config.heartbeat_ttl_s * 1000))  # fmt: skip
        pipe.sadd(self.config.workers_key(), self.worker_id)  # 1: we were not a member
        if weights is not None:
            pipe.hgetall(weights_key(self.config))
        answers = pipe.execute()
        added = answers[1]
        if weights is not None:
            weights.noticed(answers[2])
        if self._registered and added:
            logger.warning("worker %s: was taken for dead (heartbeat lapsed); registered "
                           "again", self.worker_id)  # fmt: skip
        self._registered = True

    def run(self) -> None:
        while not self.stop.wait(self.config.heartbeat_interval_s):
            stalled = time.monotonic() - self._turned_at
            loading = self.weights is not None and self.weights.loading  # busy, not hung
            if stalled > self.config.worker_stall_s and not loading:
                logger.error(
                    "worker %s: the engine loop has not turned for %.0f s; stopping the "
                    "heartbeat so its jobs move to live workers", self.worker_id, stalled,
                )  # fmt: skip
                self.on_stall()
                return
            try:
                self.beat()
            except redis.RedisError as exc:
                # The main loop sees the same outage and backs off; keep trying to beat.
                logger.warning("worker %s: heartbeat failed: %s", self.worker_id, exc)

    def goodbye(self) -> None:
        """Stop beating and delete the key: the reaper need not wait for the TTL."""
        self.stop.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join()
        self.client.delete(self.config.heartbeat_key(self.worker_id))


def _exit_hung() -> None:
    # The main thread is stuck in native code and cannot be interrupted; only ending the
    # process frees the GPU for a replacement.
    logging.shutdown()
    os._exit(70)  # EX_SOFTWARE
