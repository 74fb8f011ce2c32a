"""`streamserve batch`: OpenAI batches from the shell, through Redis or an ingress
(cli/batch_sources.py).

  submit FILE.jsonl [--endpoint E] [--wait]   upload the file and start a batch of it
  status ID [--wait] [--json]                 the batch; --wait follows it to its end
  results ID [--output F] [--errors F]        its output lines (stdout) and error lines (stderr)
  cancel ID                                   ask it to stop
  list [--limit N]                            batches, newest first

Following a batch draws a progress bar of its finished lines (completed + failed) on a
terminal, else prints a line whenever it moves, both on stderr. The ingress replicas run
the batches: this only stores and reads them.

Exit codes: 0 done (`--wait`: the batch completed), 1 a call failed (unknown batch,
unreachable deployment) or a followed batch ended failed, expired or cancelled, 2 a bad
argument, 130 Ctrl-C while following (the batch goes on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batch_store.batches import ENDED
from batch_store.client_methods import endpoint_of
from cli.batch_sources import BatchSource, BatchUnavailable, choose_source

TIMESTAMPS = ("created", "in_progress", "finalizing", "completed", "failed", "expired",
              "cancelling", "cancelled")  # fmt: skip


class BadArgument(Exception):
    """Exit code 2: the user's arguments, not the deployment."""


def run(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    command = COMMANDS[args.batch_command]
    try:
        if getattr(args, "interval", 1.0) <= 0:
            raise BadArgument(f"--interval must be positive; got {args.interval}")
        if not 1 <= getattr(args, "limit", 1) <= 100:
            raise BadArgument(f"--limit must be between 1 and 100; got {args.limit}")
        try:
            source = choose_source(args.redis_url, args.url, environ)
        except ValueError as exc:
            raise BadArgument(str(exc)) from None
        return command(args, source)
    except BadArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BatchUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def submit(args: argparse.Namespace, source: BatchSource) -> int:
    path: Path = args.file
    try:
        content = path.read_bytes()
        endpoint = args.endpoint or endpoint_of(content)
    except OSError as exc:
        raise BadArgument(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise BadArgument(f"{path}: {exc} with --endpoint") from None
    metadata = _metadata(args.metadata)  # checked before anything is stored
    upload = source.upload(content, path.name)
    batch = source.create(upload["id"], endpoint, args.completion_window, metadata)
    if not args.wait:
        print(json.dumps(batch, indent=2) if args.json else batch["id"])
        return 0
    if not args.json:
        print(batch["id"], flush=True)  # first, so a script has it while the batch runs
    return _follow(source, batch, args)


def status(args: argparse.Namespace, source: BatchSource) -> int:
    batch = source.get(args.batch_id)
    if args.wait:
        return _follow(source, batch, args)
    print(json.dumps(batch, indent=2) if args.json else describe(batch))
    return 0


def results(args: argparse.Namespace, source: BatchSource) -> int:
    batch = source.get(args.batch_id)
    if batch["status"] not in ENDED:
        raise BatchUnavailable(f"batch {batch['id']} is {batch['status']}: its results are "
                               f"written when it ends (streamserve batch status "
                               f"{batch['id']} --wait)")  # fmt: skip
    for file_key, target, stream in (("output_file_id", args.output, sys.stdout),
                                     ("error_file_id", args.errors, sys.stderr)):  # fmt: skip
        content = source.content(batch[file_key]) if batch[file_key] else b""
        _write(content, target, stream)
    return 0


def cancel(args: argparse.Namespace, source: BatchSource) -> int:
    batch = source.cancel(args.batch_id)
    print(json.dumps(batch, indent=2) if args.json else f"{batch['id']} {batch['status']}")
    return 0


def list_batches(args: argparse.Namespace, source: BatchSource) -> int:
    listing = source.list(args.limit, args.after)
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    print(f"{'id':<30} {'status':<11} {'endpoint':<21} {'done':>13}  created")
    for batch in listing["data"]:
        print(f"{batch['id']:<30} {batch['status']:<11} {batch['endpoint']:<21} "
              f"{_done(batch):>13}  {_when(batch['created_at'])}")  # fmt: skip
    if listing["has_more"]:
        print(f"(more: --after {listing['last_id']})")
    return 0


COMMANDS = {"submit": submit, "status": status, "results": results, "cancel": cancel,
            "list": list_batches}  # fmt: skip


def describe(batch: dict[str, Any]) -> str:
    """The batch for a person: what it is, how far it got, where its results are."""
    rows = [
        ("id", batch["id"]),
        ("status", batch["status"]),
        ("endpoint", batch["endpoint"]),
        ("requests", _counts(batch)),
        ("input file", batch["input_file_id"]),
        ("output file", batch["output_file_id"] or "-"),
        ("error file", batch["error_file_id"] or "-"),
        *((name, _when(batch[f"{name}_at"])) for name in TIMESTAMPS if batch.get(f"{name}_at")),
        *(("metadata", f"{k}={v}") for k, v in (batch.get("metadata") or {}).items()),
        *(("error", e["message"]) for e in ((batch.get("errors") or {}).get("data") or [])),
    ]
    return "\n".join(f"{name:<12} {value}" for name, value in rows)


def _follow(source: BatchSource, batch: dict[str, Any], args: argparse.Namespace) -> int:
    """Show the batch's progress until it ends; then the batch, and 0 if it completed."""
    try:
        batch = follow(source, batch, args.interval, sys.stderr)
    except KeyboardInterrupt:
        print(f"stopped following {batch['id']}; it goes on (streamserve batch cancel "
              f"{batch['id']} stops it)", file=sys.stderr)  # fmt: skip
        return 130
    print(json.dumps(batch, indent=2) if args.json else describe(batch))
    return 0 if batch["status"] == "completed" else 1


def follow(source: BatchSource, start: dict[str, Any], interval: float,
           stream: TextIO) -> dict[str, Any]:  # fmt: skip
    """Poll until the batch ends: a rich bar on a terminal, plain lines elsewhere. An
    unreachable deployment is told and retried: a batch can outlast a restart."""
    if not stream.isatty():
        last, batch = None, start
        for batch, error in _states(source, start, interval):
            line = f"error: {error} (retrying)" if error else (
                f"{batch['id']} {batch['status']}: {_counts(batch)}")  # fmt: skip
            if line != last:
                print(line, file=stream, flush=True)
                last = line
        return batch
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=Console(file=stream)) as progress:
        task = progress.add_task(start["id"], total=None, status="")
        batch = start
        for batch, error in _states(source, start, interval):
            if error:
                progress.update(task, status=f"[red]{escape(error)} (retrying)")
                continue
            progress.update(task, total=batch["request_counts"]["total"] or None,
                            completed=_finished(batch), status=batch["status"])  # fmt: skip
        return batch


def _states(source: BatchSource, batch: dict[str, Any],
            interval: float) -> Iterator[tuple[dict[str, Any], str | None]]:  # fmt: skip
    """(the batch, None) every `interval` until it has ended, that state last; (the last
    state, the error) when the deployment cannot be read for a while."""
    while True:
        yield batch, None
        if batch["status"] in ENDED:
            return
        time.sleep(interval)
        while True:
            try:
                batch = source.get(batch["id"])
                break
            except BatchUnavailable as exc:
                if not exc.transient:
                    raise
                yield batch, str(exc)
                time.sleep(interval)


def _finished(batch: dict[str, Any]) -> int:
    counts = batch["request_counts"]
    return counts["completed"] + counts["failed"]


def _counts(batch: dict[str, Any]) -> str:
    counts = batch["request_counts"]
    return (f"{_finished(batch)}/{counts['total']} done ({counts['completed']} completed, "
            f"{counts['failed']} failed)")  # fmt: skip


def _done(batch: dict[str, Any]) -> str:
    return f"{_finished(batch)}/{batch['request_counts']['total']}"


def _when(timestamp: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _metadata(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    if not all("=" in pair for pair in pairs):
        raise BadArgument(f"--metadata takes KEY=VALUE; got {pairs}")
    return dict(pair.split("=", 1) for pair in pairs)


def _write(content: bytes, target: Path | None, stream: TextIO) -> None:
    """Lines to a file (told on stderr), or as they are to `stream`."""
    if target is None:
        stream.flush()
        stream.buffer.write(content)  # type: ignore[attr-defined]
        stream.buffer.flush()  # type: ignore[attr-defined]
        return
    try:
        target.write_bytes(content)
    except OSError as exc:
        raise BadArgument(f"cannot write {target}: {exc.strerror or exc}") from None
    lines = content.count(b"\n")
    print(f"{lines} lines written to {target}", file=sys.stderr)
