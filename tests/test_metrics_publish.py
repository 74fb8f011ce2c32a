"""Each process's metrics published to Redis, and the deployment read back as one target:
the real server, the real prometheus-client."""

from __future__ import annotations

import time

import msgpack

from jobs.wire import DEFLATED_MARK
from observability.deployment_metrics import deployment_registry, render
from observability.metrics import (
    HELD_CALLS,
    NOOP,
    MetricsPublisher,
    ProcessMetrics,
    RateHistory,
    read_snapshots,
    start_publisher,
    unpack_snapshot,
)
from runtime.config import BusConfig
from tests.prometheus_text import total


def test_two_processes_of_one_family_are_one_family_labelled_by_process(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url)
    publishers = []
    for replica, handled in (("tokenizer-a", 3), ("tokenizer-b", 5)):
        process = ProcessMetrics("tokenizer", replica)
        process.counter("stage_entries", "Entries handled.").inc(handled)
        publishers.append(MetricsPublisher(redis_client, config, process))
    publishers[0].publish()
    text = render(deployment_registry([(redis_client, config)], publishers[1])).decode()
    # Parsed by prometheus-client: one TYPE per family, each series with its process.
    assert total(text, "streamserve:stage_entries_total", replica="tokenizer-a") == 3
    assert total(text, "streamserve:stage_entries_total", replica="tokenizer-b") == 5
    assert total(text, "streamserve:stage_entries_total", role="tokenizer") == 8
    assert text.count("# TYPE streamserve:stage_entries_total counter") == 1
    assert total(text, "streamserve:live_workers") == 0
    assert total(text, "streamserve:stream_length", stream=config.requests_stream()) == 0


def test_a_snapshot_expires_with_its_process(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, metrics_interval_s=0.1)
    process = ProcessMetrics("router", "r1")
    process.gauge("num_things", "Things.").set(2)
    publisher = start_publisher(redis_client, config, process)
    deadline = time.monotonic() + 5
    while not read_snapshots(redis_client, config):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    publisher.stop.set()
    publisher.join()
    (snapshot,) = read_snapshots(redis_client, config)
    assert (snapshot["role"], snapshot["replica"]) == ("router", "r1")
    time.sleep(0.4)  # past 3 intervals: the process is gone
    assert read_snapshots(redis_client, config) == []


def test_metrics_off_are_no_ops_and_publish_nothing(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, metrics=False)
    process = ProcessMetrics("worker", "w", enabled=config.metrics)
    counter = process.counter("generation_tokens", "Tokens.", ["kind"])
    assert counter is NOOP
    counter.labels("x").inc(3)
    process.histogram("step_seconds", "Steps.", (0.1, 1.0)).observe(0.5)
    process.histogram("itl_seconds", "Gaps.", (0.1, 1.0)).observe_later(0.5, 3)
    assert process.families() == []
    assert start_publisher(redis_client, config, process) is None


def test_rates_are_per_second_over_the_last_minute():
    process = ProcessMetrics("worker", "w")
    tokens = process.counter("generation_tokens", "Tokens.")
    history = RateHistory(window_s=60)
    history.rates(process.families(), now=1000.0)
    tokens.inc(300)
    (rate,) = [r for r in history.rates(process.families(), now=1030.0)
               if r[0] == "streamserve:generation_tokens_total"]  # fmt: skip
    assert rate[2] == 10.0
    tokens.inc(600)
    # A minute on, the first sample has left the window: the rate is of the last 60 s.
    (rate,) = [r for r in history.rates(process.families(), now=1090.0)
               if r[0] == "streamserve:generation_tokens_total"]  # fmt: skip
    assert rate[2] == 10.0


def test_observing_many_at_once_equals_observing_each():
    buckets = (0.01, 0.05, 0.1, 1.0)
    one_by_one = ProcessMetrics("ingress", "a").histogram("gap_seconds", "Gaps.", buckets)
    at_once = ProcessMetrics("ingress", "b").histogram("gap_seconds", "Gaps.", buckets)
    for amount, count in [(0.0, 4), (0.05, 3), (0.07, 1), (0.5, 2), (7.0, 5), (0.2, 0)]:
        for _ in range(count):
            one_by_one.observe(amount)
        at_once.observe_later(amount, count)
    at_once.flush()
    samples = [(s.name, s.labels, s.value) for s in one_by_one.collect()[0].samples]
    assert samples == [(s.name, s.labels, s.value) for s in at_once.collect()[0].samples]
    labelled = ProcessMetrics("ingress", "c").histogram("x_seconds", "X.", buckets, ["kind"])
    labelled.labels("a").observe_later(0.05, 2)
    labelled.labels("a").flush()
    assert [s.value for s in labelled.collect()[0].samples if s.name.endswith("_count")] == [2]


def test_observations_held_for_later_reach_the_histogram_at_a_flush():
    buckets = (0.01, 0.05, 0.1, 1.0)
    one_by_one = ProcessMetrics("ingress", "a").histogram("gap_seconds", "Gaps.", buckets)
    held = ProcessMetrics("ingress", "b").histogram("gap_seconds", "Gaps.", buckets)

    def counts(histogram):
        return [(s.name, s.value) for s in histogram.collect()[0].samples]

    empty = counts(held)
    for amount, count in [(0.0, 4), (0.05, 3), (0.07, 1), (0.5, 2), (7.0, 5), (0.2, 0)]:
        for _ in range(count):
            one_by_one.observe(amount)
        held.observe_later(amount, count)
    assert counts(held) == empty  # nothing a scrape sees until the flush
    held.flush()
    assert counts(held) == counts(one_by_one)
    held.flush()  # nothing held: nothing added twice
    assert counts(held) == counts(one_by_one)
    for _ in range(HELD_CALLS):  # past HELD_CALLS calls it flushes by itself
        held.observe_later(0.02, 1)
    assert dict(counts(held))["streamserve:gap_seconds_count"] == 15 + HELD_CALLS


def test_a_large_snapshot_is_stored_deflated_and_a_plain_one_still_reads(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url)
    process = ProcessMetrics("worker", "w-big")
    families = process.counter("stage_entries", "Entries handled.", ["stream"])
    for i in range(60):  # many series: a snapshot past 1 KiB
        families.labels(stream=f"streamserve:worker:{i}").inc(i)
    publisher = MetricsPublisher(redis_client, config, process)
    publisher.publish()
    stored = redis_client.get(publisher.key)
    plain = msgpack.packb(unpack_snapshot(stored))
    assert stored[:1] == DEFLATED_MARK and len(stored) * 2 < len(plain)
    redis_client.set(publisher.key, plain)  # as a process of an earlier version writes it
    (snapshot,) = read_snapshots(redis_client, config)
    assert snapshot["replica"] == "w-big" and snapshot == unpack_snapshot(stored)
