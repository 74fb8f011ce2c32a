"""Each process's Prometheus metrics, and their publication to Redis.

Every process (each ingress, tokenizer, router and detokenizer replica, each worker) keeps
its metrics in a prometheus-client registry of its own, and a thread publishes that
registry to Redis every ``metrics_interval_s``: one key per process with a TTL (msgpack,
deflated past 1 KiB: `pack_snapshot`), indexed in a sorted set. Any ingress serves the whole
deployment at its ``/metrics`` (observability/deployment_metrics.py), so Prometheus needs one
scrape target, behind a load balancer too, and ``streamserve up``'s processes, which share no
port, are all seen.

The published snapshot also carries each counter's rate over the last minute, computed by
the publisher from its own history, so ``streamserve status`` and ``/status`` show
throughput without keeping history of their own.

Names follow vLLM's where the same thing is measured, under a ``streamserve:`` prefix.
``STREAMSERVE_METRICS=0`` replaces every metric with a no-op (what the pipeline benchmark
compares against).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import prometheus_client
import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jobs.wire import COMPRESS_FROM_BYTES, DEFLATED_MARK, inflate
from runtime.config import BusConfig

logger = logging.getLogger(__name__)

PREFIX = "streamserve:"
RATE_WINDOW_S = 60.0
# A snapshot outlives this many publication intervals, so one late beat does not drop it.
TTL_INTERVALS = 3
# A process lists its snapshot key in the index for this many snapshot TTLs at a time, so it
# writes the index (and prunes it) once in that long rather than at every publish: an entry
# outliving its process only costs a reader one missing key in its MGET.
INDEX_TTLS = 10

# `_created` series double every counter and histogram, and no dashboard reads them.
prometheus_client.disable_created_metrics()


class _Noop:
    """What every metric is with metrics off: each call does nothing."""

    def labels(self, *_args: Any, **_kwargs: Any) -> _Noop:
        return self

    def inc(self, *_args: Any) -> None:
        pass

    dec = set = observe = observe_later = flush = inc


NOOP = _Noop()


HELD_CALLS = 64  # `WeightedHistogram.observe_later` calls held at most before a flush


class WeightedHistogram(Histogram):
    """A Histogram that also takes `count` equal observations for the cost of one, held in
    plain counters until a flush.

    A streamed delta of n tokens is n inter-token latencies; n calls of `observe` (each a
    lock and two counter increments) were a tenth of the ingress's CPU under load, and
    prometheus-client has no weighted observe; one weighted observe a delta, its two locks,
    still 3%. So `observe_later` counts into the buckets as `observe` would, without a lock,
    and `flush` adds what it holds to the histogram (what a scrape reads).
    """

    def observe_later(self, amount: float, count: int) -> None:
        """`count` observations of `amount`, held until `flush` (called by the same thread)
        or until `HELD_CALLS` calls are held."""
        if count <= 0:
            return
        # The first bucket whose upper bound is >= amount, as `observe` finds it.
        self._held[bisect.bisect_left(self._upper_bounds, amount)] += count
        self._held_sum += amount * count
        self._held_calls += 1
        if self._held_calls >= HELD_CALLS:
            self.flush()

    def flush(self) -> None:
        if not self._held_calls:
            return
        self._raise_if_not_observable()
        self._sum.inc(self._held_sum)
        for bucket, count in zip(self._buckets, self._held, strict=True):
            if count:
                bucket.inc(count)
        self._held = [0] * len(self._held)
        self._held_sum, self._held_calls = 0.0, 0

    def _metric_init(self) -> None:
        super()._metric_init()
        self._held = [0] * len(self._upper_bounds)
        self._held_sum, self._held_calls = 0.0, 0


class ProcessMetrics:
    """One process's registry; `role` and `replica` label its series in the deployment."""

    def __init__(self, role: str, replica: str, enabled: bool = True) -> None:
        self.role = role
        self.replica = replica
        self.enabled = enabled
        self.registry = CollectorRegistry(auto_describe=False)

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        if not self.enabled:
            return NOOP  # type: ignore[return-value]
        return Counter(PREFIX + name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        if not self.enabled:
            return NOOP  # type: ignore[return-value]
        return Gauge(PREFIX + name, documentation, labels, registry=self.registry)

    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> WeightedHistogram:
        if not self.enabled:
            return NOOP  # type: ignore[return-value]
        return WeightedHistogram(
            PREFIX + name, documentation, labels, registry=self.registry, buckets=buckets
        )

    def families(self) -> list[list[Any]]:
        """[name, type, documentation, [[sample name, labels, value], ...]] per family."""
        return [
            [family.name, family.type, family.documentation,
             [[s.name, s.labels, s.value] for s in family.samples]]
            for family in self.registry.collect()
        ]  # fmt: skip


class RateHistory:
    """Counter totals over the last minute, to give each one's rate."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._history: collections.deque[tuple[float, dict[tuple, float]]] = collections.deque()

    def rates(self, families: list[list[Any]], now: float) -> list[list[Any]]:
        """[[sample name, labels, per second], ...] of every counter sample."""
        totals = {
            (sample_name, tuple(sorted(labels.items()))): value
            for _name, kind, _doc, samples in families
            if kind == "counter"
            for sample_name, labels, value in samples
        }
        self._history.append((now, totals))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        then, old = self._history[0]
        elapsed = now - then
        if not elapsed:
            return [[name, dict(labels), 0.0] for name, labels in totals]
        return [
            [name, dict(labels), (value - old.get((name, labels), 0.0)) / elapsed]
            for (name, labels), value in totals.items()
        ]


def snapshot_key(config: BusConfig, role: str, replica: str) -> str:
    return config.key_name("metrics", role, replica)


def index_key(config: BusConfig) -> str:
    """Sorted set of the snapshot keys, scored by when each stops being listed (unix
    seconds; the snapshot itself may expire before)."""
    return config.key_name("metrics")


class MetricsPublisher(threading.Thread):
    """Publishes `metrics` to Redis every interval until stopped, and once more at the end."""

    def __init__(self, client: redis.Redis, config: BusConfig, metrics: ProcessMetrics) -> None:
        super().__init__(name=f"metrics-{metrics.replica}", daemon=True)
        self.client = client
        self.config = config
        self.metrics = metrics
        self.key = snapshot_key(config, metrics.role, metrics.replica)
        self.stop = threading.Event()
        self._rates = RateHistory()
        self._listed_until = 0.0  # our score in the index
        self._lock = threading.Lock()  # the thread and a scrape (an ingress's) both publish

    def publish(self) -> None:
        with self._lock:
            now = time.time()
            families = self.metrics.families()
            rates = self._rates.rates(families, now)
        snapshot = {
            "role": self.metrics.role,
            "replica": self.metrics.replica,
            "time": now,
            "families": families,
            "rates": rates,
        }
        ttl_s = TTL_INTERVALS * self.config.metrics_interval_s
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.key, pack_snapshot(snapshot), px=int(ttl_s * 1000))
        relist = now + ttl_s > self._listed_until
        if relist:
            until = now + INDEX_TTLS * ttl_s
            pipe.zadd(index_key(self.config), {self.key: until})
            pipe.zremrangebyscore(index_key(self.config), "-inf", now)
        pipe.execute()
        if relist:
            self._listed_until = until

    def run(self) -> None:
        while not self.stop.wait(self.config.metrics_interval_s):
            try:
                self.publish()
            except redis.RedisError as exc:
                logger.debug("metrics of %s not published: %s", self.metrics.replica, exc)

    def close(self) -> None:
        """Stop, and publish the last figures (a short-lived process's counts still show)."""
        self.stop.set()
        try:
            self.publish()
        except redis.RedisError:
            pass


def start_publisher(
    client: redis.Redis, config: BusConfig, metrics: ProcessMetrics
) -> MetricsPublisher | None:
    """A running publisher of `metrics`; None with metrics off."""
    if not metrics.enabled:
        return None
    publisher = MetricsPublisher(client, config, metrics)
    publisher.start()
    return publisher


def read_snapshots(client: redis.Redis, config: BusConfig) -> list[dict[str, Any]]:
    """Every live process's last snapshot."""
    keys = client.zrangebyscore(index_key(config), time.time(), "+inf")
    if not keys:
        return []
    snapshots = []
    for raw in client.mget(keys):
        if raw is not None:  # expired since the index was read
            snapshots.append(unpack_snapshot(raw))
    return snapshots


def pack_snapshot(snapshot: dict[str, Any]) -> bytes:
    """A snapshot's msgpack, deflated (level 9) from `COMPRESS_FROM_BYTES` on: its family
    and label names repeat sample after sample, so 2 to 6 KiB shrink to a quarter, and every
    process writes one every interval, busy or idle (issue 27 counts them per token too).
    Level 9 makes them 8% smaller than level 1, for ~0.1 ms every two seconds."""
    packed = msgpack.packb(snapshot)
    return zlib.compress(packed, 9) if len(packed) >= COMPRESS_FROM_BYTES else packed


def unpack_snapshot(raw: bytes) -> dict[str, Any]:
    """What `pack_snapshot` wrote, deflated or not (a process of an earlier version writes
    plain msgpack, a map, which never starts with zlib's `DEFLATED_MARK`)."""
    return msgpack.unpackb(inflate(raw) if raw[:1] == DEFLATED_MARK else raw)
