"""What one commit costs the Redis server, as a MULTI and as a script (bus/scripted_multi.py).

    python benchmarks/bench_commit_cost.py [--commits 1500] [--rounds 8] [--out f.jsonl]

Two commits of the bus, each written both ways against a private embedded server:

- worker: a publish under its fence (the TokenBatch, the progress-log entry and a
  non-blocking read of new jobs); as WATCH and GET of a fence key, then MULTI ... EXEC, or as
  one EVALSHA whose first write, the progress entry, is the fence (bus/fenced_stream.py);
- detokenizer: a hand-off (the reply entry and the XACK of its input); as MULTI ... EXEC, or
  as one EVALSHA.

The server's CPU (INFO cpu, user + system) per commit is the figure: Redis CPU is what a
shard runs out of. The rounds alternate the forms and the median is printed, so a busy
machine slows both alike. Payload sizes are a 64-request publish's (2 KB, 300 B, 1 KB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from benchmarks import jsonl  # noqa: E402
from bus.scripted_multi import ScriptedMulti  # noqa: E402
from runtime.embedded_server import EmbeddedRedis  # noqa: E402

TOKENS, PROGRESS, REPLY = os.urandom(2000), os.urandom(300), os.urandom(1000)


def commits(client: redis.Redis) -> dict[str, Callable[[], object]]:
    def worker_multi() -> None:
        with client.pipeline(transaction=True) as pipe:
            pipe.watch("fence")
            if pipe.get("fence") != b"token":
                raise RuntimeError("fenced")
            pipe.multi()
            _worker_writes(pipe, nomkstream=False)
            pipe.execute()

    def worker_script() -> None:
        pipe = ScriptedMulti(client, guarded=True)
        _worker_writes(pipe, nomkstream=True)
        pipe.execute()

    def detokenizer_multi() -> None:
        pipe = client.pipeline(transaction=True)
        _hand_off(pipe)
        pipe.execute()

    def detokenizer_script() -> None:
        pipe = ScriptedMulti(client)
        _hand_off(pipe)
        pipe.execute()

    return {"worker_multi": worker_multi, "worker_script": worker_script,
            "detokenizer_multi": detokenizer_multi,
            "detokenizer_script": detokenizer_script}  # fmt: skip


def _worker_writes(pipe, nomkstream: bool) -> None:
    pipe.xadd("progress", {"m": PROGRESS}, maxlen=100, approximate=True, nomkstream=nomkstream)
    pipe.xadd("tokens", {"m": TOKENS}, maxlen=1000, approximate=True)
    pipe.xreadgroup("worker", "w", {"jobs": ">"}, count=64)


def _hand_off(pipe) -> None:
    pipe.xadd("reply", {"m": REPLY}, maxlen=1000, approximate=True)
    pipe.xack("tokens", "detokenizer", b"1-1")


def server_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=1500, help="per round and form")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.set("fence", b"token")
        client.xadd("progress", {"m": PROGRESS})
        client.xgroup_create("jobs", "worker", id="0", mkstream=True)
        client.xgroup_create("tokens", "detokenizer", id="0", mkstream=True)
        forms = commits(client)
        samples: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, commit in forms.items():
                before = server_cpu_s(client)
                for _ in range(args.commits):
                    commit()
                samples[name].append((server_cpu_s(client) - before) / args.commits * 1e6)
        client.close()
    row = {
        "benchmark": "commit-cost",
        "commits": args.commits,
        "rounds": args.rounds,
        "server_cpu_us_per_commit": {k: round(statistics.median(v), 1) for k, v in samples.items()},
        "server": "embedded valkey",
    }
    jsonl.emit({**row, **jsonl.machine()}, args.out)


if __name__ == "__main__":
    main()
