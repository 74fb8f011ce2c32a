"""`streamserve weights`: new weights for every worker, straight through Redis.

  streamserve weights update <path or model name> [--wait] [--timeout S]
  streamserve weights status

`update` writes the fleet's weights record (jobs/weights.py), as ``POST /admin/weights``
does, and prints the version it made; with ``--wait`` it follows the live workers until each
serves that version or has failed to load it, and exits 1 if any failed (or the timeout
passed). `status` prints the version asked for and each live worker's. Whoever reaches
Redis may do this: Redis access is already an operator's; the HTTP form wants the admin key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import redis

from bus.access import redacted
from bus.weights_admin import read_fleet, set_weights
from jobs.field_error import FieldError
from jobs.weights import check_source
from runtime.cluster import shard_configs
from runtime.config import BusConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="weights_command", required=True, metavar="ACTION")
    update = actions.add_parser("update", help="every worker to serve these weights")
    update.add_argument("source", metavar="PATH_OR_MODEL",
                        help="a checkpoint folder, GGUF file or model name")  # fmt: skip
    update.add_argument("--wait", action="store_true",
                        help="follow the workers until each serves it or failed")  # fmt: skip
    update.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits")
    status = actions.add_parser("status", help="the version asked for and each worker's")
    for action in (update, status):
        action.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
        action.add_argument("--json", action="store_true", help="the answer as JSON")


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    try:
        overrides = {"redis_url": args.redis_url} if args.redis_url else {}
        config = BusConfig.from_env(os.environ if environ is None else environ, **overrides)
        if config.redis_url is None:
            raise ValueError("give --redis-url or set REDIS_URL")
        source = check_source({"model": args.source}) if args.weights_command == "update" else ""
    except (ValueError, FieldError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        shards = [(redis.Redis.from_url(c.redis_url), c) for c in shard_configs(config)]
        if args.weights_command == "status":
            return _show(read_fleet(shards), args.json)
        record = set_weights(shards, source)
        print(f"asked every worker for weights {record.version}: {record.source}", file=sys.stderr)
        if not args.wait:
            return _show(read_fleet(shards), args.json)
        return _follow(shards, record.version, args.timeout, args.json)
    except redis.RedisError as exc:
        print(f"error: cannot reach Redis at {redacted(config.redis_url)}: {exc}", file=sys.stderr)
        return 1


def _follow(shards: list, version: str, timeout: float, as_json: bool) -> int:
    """Poll until every live worker serves `version` or failed to load it."""
    deadline = time.monotonic() + timeout
    while True:
        view = read_fleet(shards)
        done = view["converged"] and (view["desired"] or {}).get("version") == version
        if done or time.monotonic() > deadline:
            _show(view, as_json)
            failed = [w for w in view["workers"] if w["version"] != version]
            if not done:
                print(f"error: not every worker serves {version} after {timeout:g} s",
                      file=sys.stderr)  # fmt: skip
            return 0 if done and not failed else 1
        time.sleep(0.5)


def _show(view: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(view, indent=2))
        return 0
    desired = view["desired"]
    if desired is None:
        print("weights asked for: none (each worker serves its --model)")
    else:
        print(f"weights asked for: {desired['version']} ({desired['source']})")
    if not view["workers"]:
        print("no live worker")
    for worker in view["workers"]:
        line = f"  {worker['id']}: {worker['version'] or '-'}"
        if worker["updating_to"]:
            line += f" -> {worker['updating_to']} (updating)"
        if worker["error"]:
            line += f" (failed: {worker['error']})"
        print(line)
    return 0
