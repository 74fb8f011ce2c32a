"""The whole deployment's metrics as one Prometheus target, served by any ingress.

At each scrape the collector publishes this process's own snapshot, reads every live
process's from Redis (metrics.py), labels each series with its process's `role` and
`replica`, and adds the streams' length, lag and pending per group (stream_stats.py) and
the count of workers with a live heartbeat (bus/liveness.py) as gauges, and the Redis
server's own figures (redis_server.py: commands, CPU, memory, clients). Series of one family
from several processes are merged under one family, as the exposition format requires. On a
Redis Cluster it reads every shard, and labels each series with its ``shard``.

Every figure comes from Redis, this replica's too: behind a load balancer, consecutive
scrapes land on different ingress replicas, and a replica that served its own counters live
and the others' as last published would show some counters going back, which Prometheus
takes for resets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bus.liveness import read_liveness
from observability.metrics import PREFIX, MetricsPublisher, read_snapshots
from observability.redis_server import read_server_figures
from observability.stream_stats import pipeline_streams, read_stream_stats
from runtime.config import BusConfig

Shard = tuple[redis.Redis, BusConfig]  # a client of one Redis (a Cluster's shard) and its names


class DeploymentCollector(Collector):
    """Over every shard of a Redis Cluster (runtime/cluster.py), each series labelled with
    its ``shard``; on one server, without that label."""

    def __init__(self, shards: list[Shard], publisher: MetricsPublisher | None) -> None:
        self.shards = shards
        self.publisher = publisher  # this process's; None with metrics off

    def collect(self) -> Iterable[Metric]:
        if self.publisher is not None:
            self.publisher.publish()  # this replica's figures as they are now
        merged: dict[str, Metric] = {}
        for client, config in self.shards:
            where = {"shard": config.shard} if len(self.shards) > 1 else {}
            for family in self._shard_families(client, config):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type))  # fmt: skip
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, **where}, sample.value)
        yield from merged.values()

    def _shard_families(self, client: redis.Redis, config: BusConfig) -> Iterable[Metric]:
        for process in read_snapshots(client, config):
            extra = {"role": process["role"], "replica": process["replica"]}
            for name, kind, documentation, samples in process["families"]:
                family = Metric(name, documentation, kind)
                for sample_name, labels, value in samples:
                    family.add_sample(sample_name, {**labels, **extra}, value)
                yield family
        yield from _stream_families(client, config)
        yield from _server_families(client)


def _server_families(client: redis.Redis) -> Iterable[Metric]:
    figures = read_server_figures(client)
    if figures is None:
        return
    for name, documentation, value in (
        ("redis_commands_processed", "Commands the Redis server processed since it "
         "started.", figures.commands_processed),
        ("redis_cpu_seconds", "CPU seconds (user + system) the Redis server spent since it "
         "started.", figures.cpu_seconds),
    ):  # fmt: skip
        yield CounterMetricFamily(PREFIX + name, documentation, value=value)
    for name, documentation, value in (
        ("redis_ops_per_second", "The Redis server's own rate of commands now.",
         figures.ops_per_second),
        ("redis_memory_used_bytes", "Memory the Redis server uses.", figures.memory_bytes),
        ("redis_maxmemory_bytes", "Its maxmemory (0: none); past it, writes are refused.",
         figures.maxmemory_bytes),
        ("redis_connected_clients", "Clients connected to the Redis server.",
         figures.connected_clients),
    ):  # fmt: skip
        yield GaugeMetricFamily(PREFIX + name, documentation, value=value)


def _stream_families(client: redis.Redis, config: BusConfig) -> Iterable[Metric]:
    liveness = read_liveness(client, config)
    live = Metric(PREFIX + "live_workers", "Workers with a live heartbeat.", "gauge")
    live.add_sample(PREFIX + "live_workers", {}, len(liveness.alive))
    yield live
    streams = pipeline_streams(config, liveness.registered)
    stats = read_stream_stats(client, list(streams))
    gauges = {
        name: Metric(PREFIX + name, documentation, "gauge")
        for name, documentation in (
            (
                "stream_length",
                "Entries in the stream (kept until every group acked them); "
                "an entry of the requests or tokenized stream may bundle several jobs.",
            ),
            ("stream_group_lag", "Entries of the stream the group has not read yet."),
            ("stream_group_pending", "Entries the group read and has not acknowledged."),
            ("stream_group_consumers", "Consumers the group has known (live or not)."),
        )
    }
    for entry in stats:
        gauges["stream_length"].add_sample(
            PREFIX + "stream_length", {"stream": entry.stream}, entry.length
        )
        for group in entry.groups:
            labels = {"stream": entry.stream, "group": group.group}
            for name, value in (("stream_group_lag", group.lag),
                                ("stream_group_pending", group.pending),
                                ("stream_group_consumers", len(group.consumers))):  # fmt: skip
                gauges[name].add_sample(PREFIX + name, labels, value)
    yield from gauges.values()


def deployment_registry(
    shards: list[Shard], publisher: MetricsPublisher | None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DeploymentCollector(shards, publisher))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The exposition text (Prometheus' text format 0.0.4)."""
    return generate_latest(registry)


def parse_families(text: str) -> dict[str, Any]:
    """Family name -> prometheus_client's parsed family: what tests and tools read back."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}
