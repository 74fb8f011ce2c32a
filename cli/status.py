"""`streamserve status`: one deployment's stages, streams, workers and throughput, drawn in
the terminal with rich, or printed as JSON for scripts.

It reads the deployment from Redis (observability/deployment_status.py), or from an ingress's
`/status.json`, which serves the same dict: the way in where Redis is out of reach, behind a
load balancer, or `streamserve up`'s private server, which has no address outside it.

Exit codes: 0 done (or Ctrl-C), 1 the deployment could not be read (`--once`), 2 nothing to
read or a bad flag.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import redis
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from bus.access import redacted
from observability.cluster_status import read_deployment_status
from runtime.cluster import shard_configs
from runtime.config import BusConfig
from stages.ingress.tenancy.auth import api_keys_from_env

INGRESS_URL_ENV = "STREAMSERVE_URL"
PIPE_WIDTH = 120
# Long enough for a loaded Redis or ingress, short enough that a dead one is soon reported.
TIMEOUT_S = 5.0

Reader = Callable[[], dict[str, Any]]


class StatusUnavailable(Exception):
    """The deployment could not be read; the message is one line for the user."""


def run(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    if args.interval <= 0:
        print(f"error: --interval must be positive; got {args.interval}", file=sys.stderr)
        return 2
    try:
        read, source = choose_reader(args.redis_url, args.url, environ)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.once:
            return _print_once(read, source, as_json=args.json)
        if args.json:
            _print_json_lines(read, args.interval)
        else:
            _show_live(read, source, args.interval)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a live view ends
    return 0


def choose_reader(
    redis_url: str | None, ingress_url: str | None, environ: Mapping[str, str]
) -> tuple[Reader, str]:
    """The flags first, then $STREAMSERVE_URL, then $REDIS_URL: the variable that names
    streamserve wins over the generic one, which may be set for some other program."""
    if ingress_url is None and redis_url is None:
        ingress_url = environ.get(INGRESS_URL_ENV, "").strip() or None
    if ingress_url is not None:
        return ingress_reader(ingress_url, environ), ingress_url
    config = BusConfig.from_env(environ, **({"redis_url": redis_url} if redis_url else {}))
    if config.redis_url is None:
        raise ValueError(
            "no deployment to read: give --redis-url (or set REDIS_URL) or an ingress's "
            f"--url (or set {INGRESS_URL_ENV})"
        )
    return redis_reader(config), redacted(config.redis_url)


def redis_reader(config: BusConfig) -> Reader:
    assert config.redis_url is not None
    shards: list[tuple[redis.Redis, BusConfig]] = []

    def read() -> dict[str, Any]:
        try:
            if not shards:  # a Redis Cluster: every shard's pipeline (runtime/cluster.py)
                shards.extend((_client(shard.redis_url), shard) for shard in shard_configs(config))
            return read_deployment_status(shards)
        except redis.RedisError as exc:
            raise StatusUnavailable(
                f"cannot read Redis at {redacted(config.redis_url)}: {exc}"
            ) from None

    return read


def _client(url: str | None) -> redis.Redis:
    assert url is not None
    return redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)


def ingress_reader(url: str, environ: Mapping[str, str]) -> Reader:
    if urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"--url must be an ingress's http:// or https:// URL; got {url!r}")
    endpoint = url.rstrip("/") + "/status.json"
    headers = {"Accept": "application/json"}
    keys = api_keys_from_env(environ)
    if keys:  # the route is open, but a proxy in front may still want the key
        headers["Authorization"] = f"Bearer {keys[0]}"

    def read() -> dict[str, Any]:
        request = urllib.request.Request(endpoint, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise StatusUnavailable(
                f"{endpoint} answered {exc.code}: {_error_message(exc)}"
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise StatusUnavailable(f"cannot reach {endpoint}: {reason}") from None
        except ValueError:
            raise StatusUnavailable(f"{endpoint} did not answer JSON") from None

    return read


def _error_message(error: urllib.error.HTTPError) -> str:
    """The OpenAI-style body's message, else the HTTP reason."""
    try:
        return json.loads(error.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return str(error.reason)


def _print_once(read: Reader, source: str, as_json: bool) -> int:
    try:
        status = read()
    except StatusUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status, indent=2))
    else:
        # A pipe gets a width of its own: rich's 80 columns would fold every table.
        Console(width=None if sys.stdout.isatty() else PIPE_WIDTH).print(render(status, source))
    return 0


def _print_json_lines(read: Reader, interval: float) -> None:
    """One document per line per refresh, for a script that follows the deployment."""
    while True:
        try:
            print(json.dumps(read()), flush=True)
        except StatusUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        time.sleep(interval)


def _show_live(read: Reader, source: str, interval: float) -> None:
    last: RenderableType | None = None  # what was read last, kept under an error
    with Live(auto_refresh=False) as live:
        while True:
            try:
                last = render(read(), source)
                live.update(last, refresh=True)
            except StatusUnavailable as exc:
                error = Text(f"error: {exc} (retrying every {interval:g} s)", style="bold red")
                live.update(Group(error, *([last] if last else [])), refresh=True)
            time.sleep(interval)


def render(status: dict[str, Any], source: str) -> RenderableType:
    when = time.strftime("%H:%M:%S", time.localtime(status["time"]))
    prefix = status["stream_prefix"]
    return Group(
        Text.assemble(("streamserve", "bold"), f"  {source}  prefix {prefix}  {when}"),
        _stages_table(status["stages"], prefix),
        _workers_table(status["workers"]),
        _throughput(status),
        *([_redis_server(status.get("redis"))] if "shards" not in status else
          [_redis_server(s["redis"], f"shard {s['shard']}") for s in status["shards"]]),
    )  # fmt: skip


def _stages_table(stages: list[dict[str, Any]], prefix: str) -> Table:
    table = Table(title="stages", title_justify="left", expand=False)
    table.add_column("stage", style="bold")
    table.add_column("replicas")
    table.add_column("input stream")  # its name past the prefix, which the title shows
    for column in ("length", "lag", "pending", "entries/s"):
        table.add_column(column, justify="right")
    table.caption = "entries, not jobs: one entry of requests or tokenized may bundle many"
    for stage in stages:
        replicas = stage["replicas"]
        ids = ", ".join(short_id(r["id"]) for r in replicas)
        has_stream = stage["stream"] is not None
        table.add_row(
            stage["name"],
            f"{len(replicas)}" + (f" ({ids})" if ids else ""),
            stage["stream"].removeprefix(prefix + ":") if has_stream else "-",
            str(stage["length"]) if has_stream else "-",
            _queue(stage["lag"]) if has_stream else "-",
            _queue(stage["pending"]) if has_stream else "-",
            f"{stage['entries_per_s']:.1f}" if has_stream else "-",
        )
    return table


def _workers_table(workers: list[dict[str, Any]]) -> RenderableType:
    if not workers:
        return Text("no live worker", style="bold red")
    table = Table(title="workers", title_justify="left", expand=False)
    table.add_column("worker", style="bold")
    table.add_column("model")
    # hits: the prefix cache's hit rate; cached/exp: tokens it found against those the
    # routers expected it to (KV-aware routing).
    for column in ("running", "waiting", "KV use", "tok/s", "hits", "cached/exp", "lag/pending",
                   "heartbeat"):  # fmt: skip
        table.add_column(column, justify="right")
    table.add_column("attention")
    for worker in workers:
        table.add_row(
            worker["id"],
            worker["model"],
            str(worker["running"]),
            _queue(worker["waiting"]),
            f"{100 * worker['kv_usage']:.1f}%",
            f"{worker['tokens_per_s']:.1f}",
            _percent(worker.get("prefix_hit_rate")),
            f"{worker.get('cached_tokens', 0)}/{worker.get('expected_cached_tokens', 0)}",
            f"{worker['lag']}/{worker['pending']}",
            f"{worker['heartbeat_age_s']:.1f} s",
            worker["attention"] or "-",
        )
    return Group(table, *_weights_lines(workers))


def _weights_lines(workers: list[dict[str, Any]]) -> list[Text]:
    """The weights each worker serves, under the table (a column would squeeze the ids): one
    line per version, then each update under way and each failed one."""
    serving: dict[str, list[str]] = {}
    for worker in workers:
        serving.setdefault(worker.get("weights_version") or "-", []).append(worker["id"])
    lines = [Text(f"weights {version}: {', '.join(ids)}") for version, ids in serving.items()]
    lines += [Text(f"  {w['id']} updating to {w['weights_target']}", style="yellow")
              for w in workers if w.get("weights_target")]  # fmt: skip
    lines += [Text(f"  {w['id']} failed to update: {w['weights_error']}", style="red")
              for w in workers if w.get("weights_error")]  # fmt: skip
    return lines


def _throughput(status: dict[str, Any]) -> Group:
    rates, totals = status["throughput"], status["totals"]
    dead = status["dead_letters"]
    # Jobs routed, by why (KV-aware routing).
    routed = ", ".join(f"{reason} {count}" for reason, count in status.get("routing", {}).items())
    return Group(
        Text.assemble(
            f"last {rates['window_s']:g} s: ",
            (f"{rates['requests_per_s']:.2f} req/s", "bold"),
            f", {rates['prompt_tokens_per_s']:.1f} prompt tok/s",
            f", {rates['generation_tokens_per_s']:.1f} gen tok/s",
        ),
        Text.assemble(
            f"totals: {totals['requests']:.0f} requests, {totals['generation_tokens']:.0f} "
            f"tokens, {totals['http_requests']:.0f} HTTP requests; ",
            (f"dead letters: {dead}", "bold red" if dead else ""),
        ),
        Text(f"routing: {routed or '-'}"),
    )


def _redis_server(figures: dict[str, Any] | None, name: str = "redis") -> Text:
    """The bus's own server (or a Cluster's shard): how close it is to its limits (memory
    against maxmemory, past which it refuses writes)."""
    if figures is None:
        return Text(f"{name}: no figures (INFO refused)", style="dim")
    used, limit = figures["memory_bytes"], figures["maxmemory_bytes"]
    memory = f"{used / 2**20:.1f} MiB" + (f" of {limit / 2**20:.0f} MiB" if limit else "")
    full = limit and used >= 0.9 * limit
    return Text.assemble(
        f"{name}: ",
        (f"{figures['ops_per_second']:.0f} ops/s", "bold"),
        f", {figures['commands_processed']} commands, {figures['cpu_seconds']:.1f} CPU s, ",
        (memory, "bold red" if full else ""),
        f", {figures['connected_clients']} clients",
    )


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _queue(count: int) -> Text:
    """A queue depth; one that is not empty stands out."""
    return Text(str(count), style="yellow" if count else "")


def short_id(replica: str) -> str:
    """``<kind>-<host>-<pid>-<suffix>`` (bus/actor.py) as ``<pid>-<suffix>``: unique, and
    short enough for a table cell."""
    parts = replica.rsplit("-", 2)
    return "-".join(parts[-2:]) if len(parts) == 3 else replica
