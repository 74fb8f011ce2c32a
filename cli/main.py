"""The `streamserve` command.

  streamserve up                     every stage on this machine (embedded Redis by default)
  streamserve stage <name>           one replica of ingress, tokenizer, router, detokenizer
  streamserve worker [engine flags]  one GPU worker (python -m gpu_worker)
  streamserve bench                  the shared workloads against a running system
  streamserve status                 a live view of a deployment's stages, workers, throughput
  streamserve batch <action>         OpenAI batches: submit, status, results, cancel, list
  streamserve gpu-check              the GPU path checked and timed on this machine's GPU
  streamserve weights <action>       new weights for every worker: update, status

Every command takes the Redis URL from --redis-url or $REDIS_URL, and the model from
--model or $STREAMSERVE_MODEL; `status` and `batch` read an ingress's URL (--url) instead
where Redis is out of reach; `status`, `batch` and `weights` need no model, and `gpu-check`
takes no Redis (its --model defaults to random:llama-3.1-8b).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from batch_store.input_file import ENDPOINTS
from cli.run_stage import STAGES
from cli.weights import add_arguments as weights_arguments
from cli.worker_command import GPU_CHECK_MODULE, worker_command
from runtime import event_loop
from runtime.config import BusConfig
from runtime.model_files import DEFAULT_MODEL

DEFAULT_PORT = 8000


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    parser.add_argument(
        "--model",
        default=os.environ.get("STREAMSERVE_MODEL") or DEFAULT_MODEL,
        help=f"default: $STREAMSERVE_MODEL or {DEFAULT_MODEL}",
    )
    parser.add_argument("--log-level", default=os.environ.get("STREAMSERVE_LOG_LEVEL", "INFO"))


def _ingress_limits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-body-bytes", type=int, default=8 * 2**20,
                        help="largest request body (413 beyond; default 8 MiB)")  # fmt: skip
    parser.add_argument("--max-queue", type=int, default=10_000,
                        help="jobs waiting before ingress answers 429 (default 10000)")  # fmt: skip


def _source(parser: argparse.ArgumentParser) -> None:
    """Redis or an ingress: what `status` and `batch` read."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    source.add_argument(
        "--url",
        default=None,
        help="an ingress to read it from (default: $STREAMSERVE_URL, which wins over $REDIS_URL)",
    )


def _status(parser: argparse.ArgumentParser) -> None:
    _source(parser)
    parser.add_argument("--once", action="store_true", help="show it once and exit")
    parser.add_argument(
        "--json", action="store_true", help="one JSON document with --once, else one per line"
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")


def _batch(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="batch_command", required=True, metavar="ACTION")
    submit = actions.add_parser("submit", help="upload a JSONL file and start a batch of it")
    submit.add_argument("file", type=Path, metavar="FILE.jsonl")
    submit.add_argument("--endpoint", choices=ENDPOINTS, default=None,
                        help="default: the first line's url")  # fmt: skip
    submit.add_argument("--completion-window", default="24h", help="default: 24h (the one)")
    submit.add_argument("--metadata", action="append", metavar="KEY=VALUE",
                        help="a metadata pair of the batch (repeatable)")  # fmt: skip
    status = actions.add_parser("status", help="a batch's status and request counts")
    results = actions.add_parser("results", help="an ended batch's output and error lines")
    cancel = actions.add_parser("cancel", help="ask a batch to stop")
    for action in (status, results, cancel):
        action.add_argument("batch_id", metavar="ID")
    for action in (submit, status):
        action.add_argument("--wait", action="store_true",
                            help="follow it to its end (exit 1 unless it completed)")  # fmt: skip
        action.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    results.add_argument("--output", type=Path, default=None, help="default: stdout")
    results.add_argument("--errors", type=Path, default=None, help="default: stderr")
    listing = actions.add_parser("list", help="batches, newest first")
    listing.add_argument("--limit", type=int, default=20, help="at most this many (1-100)")
    listing.add_argument("--after", default=None, metavar="ID", help="the page after this one")
    for action in (submit, status, cancel, listing):
        action.add_argument("--json", action="store_true", help="the object(s) as JSON")
    for action in (submit, status, results, cancel, listing):
        _source(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamserve", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start every stage on this machine")
    _common(up)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=DEFAULT_PORT)
    for flag, what in (
        ("--ingress", "ingress"),
        ("--tokenizers", "tokenizer"),
        ("--routers", "router"),
        ("--detokenizers", "detokenizer"),
        ("--workers", "worker"),
    ):
        up.add_argument(
            flag,
            type=int,
            default=1,
            help=f"replicas of the {what} (default 1; on a Redis Cluster, per shard)",
        )
    up.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for every worker, e.g. --worker-arg=--max-running-requests=64",
    )
    up.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism: each worker's model split over N ranks (its --tp)",
    )
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait")
    # Only for the embedded server: a server given by URL keeps (or not) its own data.
    persistence = up.add_mutually_exclusive_group()
    persistence.add_argument(
        "--redis-data",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the embedded server keeps its append-only file "
        "(default: $STREAMSERVE_CACHE/redis, else ~/.cache/streamserve/redis)",
    )
    persistence.add_argument(
        "--no-redis-persistence",
        action="store_true",
        help="the embedded server keeps nothing on disk: its data dies with it",
    )
    _ingress_limits(up)

    stage = commands.add_parser("stage", help="run one replica of a CPU stage")
    stage.add_argument("name", choices=STAGES)
    _common(stage)
    stage.add_argument("--host", default="0.0.0.0", help="ingress only")
    stage.add_argument("--port", type=int, default=DEFAULT_PORT, help="ingress only")
    _ingress_limits(stage)

    worker = commands.add_parser(
        "worker", help="run one GPU worker; other flags go to the engine (see --help-engine)"
    )
    _common(worker)
    worker.add_argument("--help-engine", action="store_true", help="list the engine flags")

    bench = commands.add_parser("bench", help="run the shared workloads against a running system")
    _common(bench)
    _status(commands.add_parser("status", help="a live view of a deployment (Ctrl-C ends it)"))
    _batch(commands.add_parser("batch", help="OpenAI batches: submit, status, results, ..."))
    weights_arguments(commands.add_parser("weights", help="new weights for every worker"))
    commands.add_parser(
        "gpu-check", add_help=False,
        help="check and time the GPU path on this machine (flags: streamserve gpu-check --help)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "gpu-check":  # its own flags, parsed by the module
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", GPU_CHECK_MODULE, *extra])
    if extra and args.command not in ("worker", "bench"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "status":  # a reader: no model, no log set-up, no embedded server
        from cli.status import run as show_status

        return show_status(args)
    if args.command == "weights":  # a writer of one record, and a reader
        from cli.weights import run as run_weights

        return run_weights(args)
    if args.command == "batch":  # a reader too
        from cli.batch import run as run_batch

        return run_batch(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    if args.command == "worker":
        return _exec_worker(args, extra)
    if args.command == "bench":
        from cli.bench import main as bench_main

        return bench_main([*(["--redis-url", args.redis_url] if args.redis_url else []),
                           "--model", args.model, *extra])  # fmt: skip
    try:
        config = BusConfig.from_env(**({"redis_url": args.redis_url} if args.redis_url else {}))
        event_loop.loop_name()  # a bad STREAMSERVE_EVENT_LOOP stops here, not in a child
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "up":
        from cli.launcher import Launcher

        return Launcher(args, config).run()
    from cli.run_stage import run_stage

    try:
        run_stage(args.name, config, model=args.model, host=args.host, port=args.port,
                  max_body_bytes=args.max_body_bytes, max_queue=args.max_queue)  # fmt: skip
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _exec_worker(args: argparse.Namespace, extra: list[str]) -> int:
    if args.help_engine:
        extra = ["--help"]
    command = worker_command(args.redis_url, args.model, [*extra, "--log-level", args.log_level])
    sys.stdout.flush()
    os.execv(sys.executable, command)  # the worker replaces this process: signals reach it
