"""One deployment's live picture, read from Redis: what `streamserve status` shows and the
ingress's `/status` page draws (from `/status.json`).

Stages in pipeline order with their live replicas (processes whose metrics snapshot has not
expired, metrics.py), their input stream's length, lag and pending entries; each worker
with its heartbeat's load, its KV use, its tokens per second and its prefix cache (hit
rate, tokens found cached against what the routers expected there); the routers' decisions
by reason (stages/router/kv_routing.py); throughput over the last
minute, from the rates each process publishes; totals since the live processes started; and
the Redis server's own figures (redis_server.py).
A JSON-ready dict, so scripts read it with ``streamserve status --once --json``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import redis

from bus.fenced_stream import WORKER_GROUP
from bus.liveness import read_liveness
from observability.metrics import PREFIX, RATE_WINDOW_S, read_snapshots
from observability.redis_server import read_server_figures
from observability.stream_stats import STAGE_STREAMS, read_stream_stats
from runtime.config import BusConfig

PIPELINE = ("ingress", "tokenizer", "router", "worker", "detokenizer")


def read_status(client: redis.Redis, config: BusConfig) -> dict[str, Any]:
    snapshots = read_snapshots(client, config)
    server = read_server_figures(client)
    by_role: dict[str, list[dict]] = defaultdict(list)
    for snapshot in snapshots:
        by_role[snapshot["role"]].append(snapshot)
    beats = list(read_liveness(client, config).beats.values())
    stage_streams = {stage: getattr(config, method)() for stage, method in STAGE_STREAMS}
    worker_streams = {beat.worker_id: beat.stream for beat in beats}
    # The detokenizers read the workers' logs too (bus/fenced_stream.py): their backlog.
    logs = [config.progress_stream(beat.worker_id) for beat in beats]
    stats = {
        s.stream: s
        for s in read_stream_stats(
            client, [*stage_streams.values(), *worker_streams.values(), *logs,
                     config.dead_letter_stream()],
        )
    }  # fmt: skip
    stages = []
    for name in PIPELINE:
        if name == "worker":
            continue  # workers have a section of their own
        stream = stage_streams.get(name)
        entry: dict[str, Any] = {"name": name, "stream": stream}
        read = [stream, *(logs if name == "detokenizer" else ())] if stream else []
        groups = [g for g in (_group(stats.get(s), name) for s in read) if g is not None]
        entry.update(
            length=stats[stream].length if stream else None,
            lag=sum(g.lag for g in groups),
            pending=sum(g.pending for g in groups),
        )
        entry["replicas"] = [
            {"id": s["replica"], "pending": sum(g.consumers.get(s["replica"], 0) for g in groups),
             "entries_per_s": _rate(s, "stage_entries_total"),
             "requests_in_flight": _value(s, "requests_in_flight")}
            for s in sorted(by_role.get(name, []), key=lambda s: s["replica"])
        ]  # fmt: skip
        entry["entries_per_s"] = sum(r["entries_per_s"] for r in entry["replicas"])
        stages.append(entry)
    routers = by_role.get("router", [])
    expected: dict[str, float] = defaultdict(float)  # worker -> cached tokens routers expected
    decisions: dict[str, float] = defaultdict(float)  # reason -> jobs routed
    for s in routers:
        for worker, tokens in _by_label(s, "router_expected_cached_tokens_total", "worker").items():
            expected[worker] += tokens
        for reason, count in _by_label(s, "router_decisions_total", "reason").items():
            decisions[reason] += count
    workers = []
    worker_snapshots = {s["replica"]: s for s in by_role.get("worker", [])}
    for beat in beats:
        snapshot = worker_snapshots.get(beat.worker_id)
        group = _group(stats.get(beat.stream), WORKER_GROUP)
        used = beat.total_kv_tokens - beat.free_kv_tokens
        workers.append({
            "id": beat.worker_id, "model": beat.model, "stream": beat.stream,
            "running": beat.running, "waiting": beat.waiting,
            "kv_usage": used / beat.total_kv_tokens if beat.total_kv_tokens else 0.0,
            "tokens_per_s": _rate(snapshot, "generation_tokens_total") if snapshot else 0.0,
            "lag": group.lag if group else 0, "pending": group.pending if group else 0,
            "attention": beat.attention, "heartbeat_age_s": max(0.0, time.time() - beat.time),
            # The weights it serves, the version it drains for or loads, and its last
            # failed update's reason (gpu_worker/weights_update.py).
            "weights_version": beat.weights_version, "weights_target": beat.weights_target,
            "weights_error": beat.weights_error,
            **_prefix_cache(snapshot, expected.get(beat.worker_id, 0.0)),
        })  # fmt: skip
    all_workers = by_role.get("worker", [])
    ingresses = by_role.get("ingress", [])
    return {
        "time": time.time(),
        "stream_prefix": config.key_prefix,  # what every name starts with
        "stages": stages,
        "workers": workers,
        "throughput": {
            "window_s": RATE_WINDOW_S,
            "requests_per_s": sum(_rate(s, "request_success_total") for s in all_workers),
            "prompt_tokens_per_s": sum(_rate(s, "prompt_tokens_total") for s in all_workers),
            "generation_tokens_per_s": sum(
                _rate(s, "generation_tokens_total") for s in all_workers
            ),
        },
        "totals": {
            "requests": int(sum(_value(s, "request_success_total") for s in all_workers)),
            "generation_tokens": int(
                sum(_value(s, "generation_tokens_total") for s in all_workers)
            ),
            # The API's, not the monitoring's (/metrics, /status.json, /health).
            "http_requests": int(sum(_value(s, "requests_total", _api_route) for s in ingresses)),
        },
        "routing": {reason: int(count) for reason, count in sorted(decisions.items())},
        "dead_letters": stats[config.dead_letter_stream()].length,
        "redis": None if server is None else asdict(server),
    }


def _group(stats, name: str):
    if stats is None:
        return None
    return next((g for g in stats.groups if g.group == name), None)


def _value(snapshot: dict[str, Any], sample: str, where=lambda labels: True) -> float:
    """The sum of a sample's values over its labels (those `where` keeps) in one process's
    snapshot."""
    name = PREFIX + sample
    return sum(value for family in snapshot["families"] for sample_name, labels, value in family[3]
               if sample_name == name and where(labels))  # fmt: skip


def _by_label(snapshot: dict[str, Any], sample: str, label: str) -> dict[str, float]:
    """A sample's values in one process's snapshot, summed by one label's value."""
    name, out = PREFIX + sample, {}
    for family in snapshot["families"]:
        for sample_name, labels, value in family[3]:
            if sample_name == name and label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def _prefix_cache(snapshot: dict[str, Any] | None, expected: float) -> dict[str, Any]:
    """A worker's prefix cache figures since it started: hit rate, tokens found cached, and
    the tokens the routers expected it to find (KV-aware routing)."""
    queries = _value(snapshot, "prefix_cache_queries_total") if snapshot else 0.0
    hits = _value(snapshot, "prefix_cache_hits_total") if snapshot else 0.0
    return {"prefix_hit_rate": hits / queries if queries else None,
            "cached_tokens": int(hits), "expected_cached_tokens": int(expected)}  # fmt: skip


def _api_route(labels: dict[str, str]) -> bool:
    return labels.get("endpoint", "").startswith(("/v1/", "/generate"))


def _rate(snapshot: dict[str, Any], sample: str) -> float:
    """Per second over the last minute, summed over the sample's labels."""
    name = PREFIX + sample
    return sum(rate for sample_name, _, rate in snapshot.get("rates", []) if sample_name == name)
