"""The worker stage's command line, `python -m gpu_worker`: every EngineConfig field is a
flag, and `--help` prints the worker's own description (gpu_worker/worker.py). With
``--synthetic`` the worker runs gpu_worker/synthetic_engine.py instead of the model, and
takes that engine's flags instead of the model's (nor does it import torch).

On a Redis Cluster the worker attaches to one shard by itself (runtime/cluster.py: the one
with the fewest live workers, or ``STREAMSERVE_SHARD``'s), and exits with
`EXIT_SHARD_MOVED` if that shard's slots move while it runs, for its supervisor to start it
again on the new layout.

A worker loads the weights the fleet's record names (jobs/weights.py) when one is set, not its
``--model``: so a worker started after an update serves the new version. Where that record's
weights cannot load here, it serves ``--model`` and reports why in its heartbeat."""

from __future__ import annotations

import argparse
import logging
import secrets
import socket
import sys

import redis

from bus.access import attach_checked, redacted
from bus.actor import stop_on_signals
from gpu_worker import worker as worker_module
from gpu_worker.synthetic_engine import add_synthetic_arguments, synthetic_engine_from
from gpu_worker.weights_update import WeightsUpdates
from jobs.weights import WeightsRecord, initial_version, weights_key
from runtime.cluster import EXIT_SHARD_MOVED, is_slot_moved
from runtime.config import BusConfig
from runtime.model_files import DEFAULT_MODEL

SYNTHETIC_OPTIONS = ("synthetic", "synthetic_step_ms", "synthetic_batch")
logger = logging.getLogger(__name__)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{secrets.token_hex(3)}".replace(":", "-")


def _engine_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (forward_hooks as JSON), so the worker takes every
    engine option without a second list to keep in step."""
    import dataclasses
    import json

    from gpu_worker.config import EngineConfig

    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            # --flag / --no-flag: a bool that defaults to True can be turned off too.
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif f.name == "forward_hooks":
            parser.add_argument(flag, type=json.loads, default=None, help="JSON list")
        else:
            convert = int if "int" in kind else float if "float" in kind else str
            parser.add_argument(flag, type=convert, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpu_worker",
        description=worker_module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--worker-id", default=None, help="default: <host>-<random>")
    parser.add_argument("--log-level", default="INFO")
    add_synthetic_arguments(parser)
    if "--synthetic" not in (sys.argv[1:] if argv is None else argv):
        _engine_option_arguments(parser)  # imports torch, which a synthetic worker never needs
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    config = BusConfig.from_env(**({"redis_url": args.redis_url} if args.redis_url else {}))
    if config.redis_url is None:
        print("error: give --redis-url or set REDIS_URL", file=sys.stderr)
        return 2
    options = {
        key: value
        for key, value in vars(args).items()
        if value is not None
        and key not in ("redis_url", "model", "worker_id", "log_level", *SYNTHETIC_OPTIONS)
    }
    requested = config
    worker_id = args.worker_id or default_worker_id()
    model, weights = args.model, None
    try:
        # Before the model loads: a typo should fail fast.
        config = attach_checked(config, "worker")
        engine = synthetic_engine_from(args)
        if engine is None:
            engine, model, weights = _engine_on_fleet_weights(config, args.model, options,
                                                              worker_id)  # fmt: skip
        if requested.shard is None and config.shard is not None:
            # Picked again now: workers started together were all loading until now, none
            # beating, so the first pick put them all on one shard.
            config = attach_checked(requested, "worker")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    client = redis.Redis.from_url(config.redis_url)
    worker = worker_module.Worker(engine, client, config, worker_id, model, weights)
    stop_on_signals(worker.stop, worker.intake.wake)
    try:
        worker.run()
    except redis.ResponseError as exc:
        if not is_slot_moved(exc):
            raise
        logger.error("worker: shard %s moved off %s (%s); exiting to attach again",
                     config.shard, redacted(config.redis_url), exc)  # fmt: skip
        return EXIT_SHARD_MOVED
    return 0


def _engine_on_fleet_weights(
    config: BusConfig, model: str, options: dict, worker_id: str
) -> tuple[object, str, WeightsUpdates]:
    """The engine on the fleet record's weights, what it loaded, and its weights' state; on
    `model` where no record is set or the record's weights fail to load here (then the
    worker does not try that version again, and its heartbeat says why)."""
    from gpu_worker.engine import Engine  # torch: only for a worker with a model

    error, record = None, None
    try:
        with redis.Redis.from_url(config.redis_url) as client:
            record = WeightsRecord.from_mapping(client.hgetall(weights_key(config)))
    except ValueError as exc:  # a record written by hand, malformed: serve --model
        error = str(exc)
    except redis.RedisError as exc:  # the heartbeat reads it once Redis answers, and updates
        logger.warning("worker %s: cannot read the fleet's weights record (%s); loading %s",
                       worker_id, exc, model)  # fmt: skip
    if record is not None:
        try:
            engine = Engine(record.source, **options)
            return engine, record.source, WeightsUpdates(worker_id, record.version)
        except Exception as exc:  # the record's weights do not load here
            error = f"{record.version}: {type(exc).__name__}: {exc}"
            logger.error("worker %s: the fleet's weights %s (%s) did not load: %s; serving %s",
                         worker_id, record.version, record.source, exc, model)  # fmt: skip
    failed = () if record is None else (record.version,)
    weights = WeightsUpdates(worker_id, initial_version(model), error, failed)
    return Engine(model, **options), model, weights
