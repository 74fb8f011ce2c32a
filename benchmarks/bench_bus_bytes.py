"""Where the bytes into Redis go, per generated token: bench_bus_cost.py's workload with a
``MONITOR`` client on the server, each command's request size (RESP framing included) summed
by command and stream, and each stream entry's msgpack taken apart by field.

    python benchmarks/bench_bus_bytes.py [--workload mixed-64] [--synthetic-step-ms 10]

Prints one JSON line: ``bytes_in_per_token`` (the server's INFO, as bench_bus_cost.py reads
it), ``monitored_per_token`` (the sum of what MONITOR saw: the two agree within a few per
cent), ``by_command`` (``XADD <stream>`` for entries, ``<COMMAND> <key kind>`` otherwise) and
``by_field``: ``<stream>/<kind>/<field>`` packed bytes per token, items of token batches and
deltas of bundles field by field, scaled by the entry's deflate ratio where it is deflated
(so a field's share of the deflated bytes, not exact). MONITOR slows the server, so a run
makes a few more publishes (and commands) than bench_bus_cost.py's: read the parts here,
the totals there. Byte counts, not timings: safe to run on a busy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import re
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import msgpack
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline import WARM_UP, bus_workload_parser, client_options, started_pipeline  # noqa: E402

from benchmarks.jsonl import emit  # noqa: E402
from cli import bench  # noqa: E402
from cli.workloads import make_workload  # noqa: E402
from jobs.wire import DEFLATED_MARK, JOBS_FIELD  # noqa: E402

# Not counted: the benchmark's own calls around the workload.
MARK = b"bench-bus-bytes-start"
_ESCAPES = {b"\\": b"\\", b'"': b'"', b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a",
            b"b": b"\b"}  # fmt: skip
_XADD_OPTIONS = {b"NOMKSTREAM", b"MAXLEN", b"MINID", b"LIMIT", b"~", b"="}


def monitor(redis_url: str, out: str, stop: Any) -> None:
    """Every command the server runs, as MONITOR writes it, one line each into `out` (in a
    process of its own: a thread beside the workload's event loop falls behind)."""
    connection = redis.Redis.from_url(redis_url).connection_pool.get_connection()
    connection.send_command("MONITOR")
    connection.read_response()
    with open(out, "wb") as file:
        while not stop.is_set():
            if connection.can_read(timeout=0.2):
                line = connection.read_response()
                file.write((line if isinstance(line, bytes) else line.encode()) + b"\n")


def command_args(line: bytes) -> list[bytes]:
    """A MONITOR line's arguments, unescaped: ``<time> [<db> <client>] "ARG" "ARG" ...``."""
    at = line.index(b"] ") + 2
    args = []
    while at < len(line):
        at += 1  # the opening quote
        arg = bytearray()
        while line[at : at + 1] != b'"':
            if line[at : at + 1] == b"\\":
                escape = line[at + 1 : at + 2]
                if escape == b"x":
                    arg.append(int(line[at + 2 : at + 4], 16))
                    at += 4
                    continue
                arg += _ESCAPES[escape]
                at += 2
                continue
            arg += line[at : at + 1]
            at += 1
        args.append(bytes(arg))
        at += 2  # the closing quote and the space
    return args


def resp_size(args: list[bytes]) -> int:
    return len(f"*{len(args)}\r\n") + sum(len(f"${len(a)}\r\n") + len(a) + 2 for a in args)


def key_kind(key: bytes) -> str:
    """``<p>:reply:ingress-1`` -> ``reply``: the part after the prefix (a shard's tag out)."""
    parts = re.sub(rb"\{[^}]*\}", b"", key).decode(errors="replace").split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def entry_fields(args: list[bytes]) -> list[tuple[bytes, bytes]]:
    """An XADD's field-value pairs (after its key, options and id)."""
    at = 2
    while args[at].upper() in _XADD_OPTIONS or args[at - 1].upper() in _XADD_OPTIONS - {
        b"NOMKSTREAM"
    }:
        at += 1
    return list(zip(args[at + 1 :: 2], args[at + 2 :: 2], strict=True))


def field_sizes(stream: str, payload: bytes, field: bytes) -> collections.Counter[str]:
    """The packed size of each field of an entry's message (items and deltas field by
    field), scaled to the payload's share if it is deflated."""
    plain = zlib.decompress(payload) if payload[:1] == DEFLATED_MARK else payload
    sizes: collections.Counter[str] = collections.Counter()
    message = msgpack.unpackb(plain, raw=False, strict_map_key=False)
    if field == JOBS_FIELD:
        for job in message:
            _add_map(sizes, f"{stream}/job", msgpack.unpackb(job, raw=False))
        return sizes
    if not isinstance(message, dict):
        return sizes
    prefix = f"{stream}/{message.get('kind')}"
    for name in ("items", "deltas"):
        for record in message.pop(name, None) or ():
            _add_map(sizes, f"{prefix}/{name}", record)
    _add_map(sizes, prefix, message)
    ratio = len(payload) / len(plain)
    return collections.Counter({name: size * ratio for name, size in sizes.items()})


def _add_map(sizes: collections.Counter[str], prefix: str, record: Any) -> None:
    if isinstance(record, dict):
        for name, value in record.items():
            sizes[f"{prefix}/{name}"] += len(msgpack.packb(name)) + len(
                msgpack.packb(value, use_bin_type=True)
            )


def breakdown(lines: list[bytes]) -> tuple[collections.Counter, collections.Counter, int]:
    """(bytes by command, bytes by field, total) of the commands after the start mark."""
    by_command: collections.Counter[str] = collections.Counter()
    by_field: collections.Counter[str] = collections.Counter()
    total, started = 0, False
    for line in lines:
        try:
            args = command_args(line)
        except (ValueError, KeyError, IndexError):
            continue  # not a command line (MONITOR's own "OK")
        name = args[0].upper()
        if not started:
            started = name == b"ECHO" and args[1:] == [MARK]
            continue
        size = resp_size(args)
        total += size
        if name in (b"XREAD", b"XREADGROUP"):  # named by their stream, after STREAMS
            key = args[[arg.upper() for arg in args].index(b"STREAMS") + 1]
        else:
            key = args[1] if len(args) > 1 else b""
        kind = key_kind(key) if key else ""
        if name != b"XADD":
            by_command[f"{name.decode()} {kind}".strip()] += size
            continue
        by_command[f"XADD {kind}"] += size
        for field, payload in entry_fields(args):
            try:
                by_field.update(field_sizes(kind, payload, field))
            except (ValueError, zlib.error, msgpack.ExtraData):
                by_field[f"{kind}/(not msgpack)"] += len(payload)
    return by_command, by_field, total


def measure(args: argparse.Namespace) -> dict:
    up_args = []
    if args.synthetic_step_ms is not None:
        up_args = ["--worker-arg=--synthetic", f"--worker-arg=--synthetic-step-ms="
                   f"{args.synthetic_step_ms}", "--worker-arg=--synthetic-batch=64"]  # fmt: skip
        args.dtype = None
    out = Path(args.monitor_file)
    with started_pipeline(args, log_level="WARNING", up_args=up_args) as (url, redis_url):
        options = client_options(url, args)
        asyncio.run(bench.run_source(options, WARM_UP))
        stop = multiprocessing.Event()
        watcher = multiprocessing.Process(target=monitor, args=(redis_url, str(out), stop))
        watcher.start()
        time.sleep(1.0)  # MONITOR is on before the mark
        server = redis.Redis.from_url(redis_url)
        server.config_resetstat()
        server.echo(MARK)  # CONFIG is not shown by MONITOR: this marks the start
        (row,) = asyncio.run(bench.run_source(options, make_workload(args.workload)))
        bytes_in = server.info("stats")["total_net_input_bytes"]
        time.sleep(1.0)  # what MONITOR has sent reaches the file
        stop.set()
        watcher.join(timeout=10)
    by_command, by_field, total = breakdown(out.read_bytes().splitlines())
    tokens = row["output_tokens"]
    return {
        "workload": args.workload,
        "api": args.api,
        "synthetic_step_ms": args.synthetic_step_ms,
        "output_tokens": tokens,
        "bytes_in_per_token": round(bytes_in / tokens, 1),
        "monitored_per_token": round(total / tokens, 1),
        "by_command": {k: round(v / tokens, 2) for k, v in by_command.most_common()},
        "by_field": {k: round(v / tokens, 2) for k, v in by_field.most_common(args.fields)},
    }


def main() -> None:
    parser = bus_workload_parser(__doc__)
    parser.add_argument("--synthetic-step-ms", type=float, default=10.0,
                        help="a synthetic worker of this step time (default 10)")  # fmt: skip
    parser.add_argument("--fields", type=int, default=40, help="the largest fields to print")
    parser.add_argument("--monitor-file", default="/tmp/bench-bus-bytes.monitor")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    emit(measure(args), args.out)


if __name__ == "__main__":
    main()
