"""What one publish's entries cost to write and read, per token, in each stage that does it.

    python benchmarks/bench_wire_codec.py [--requests 64] [--tokens 5] [--repeats 300]
        [--out f.jsonl]

A publish of a busy worker: `--requests` requests, each `--tokens` new tokens (a 50 ms publish
of 10 ms steps gives 5) with a real-sized rid, the ingress's reply stream and an 8-token
context. Timed in process CPU time, per generated token:

- worker: encoding its TokenBatch and its progress log entry (jobs/protocol.py, progress.py);
- detokenizer: decoding that batch, and encoding the TextDeltas bundle it writes back;
- ingress: decoding that bundle.

with each entry's size in bytes as written (deflated past 1 KiB: jobs/wire.py). No Redis,
no model: the codec alone, so a change to the wire format can be weighed in isolation
before `bench_bus_load.py` measures the whole pipeline.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402
from jobs.progress import ProgressEntry  # noqa: E402
from jobs.protocol import TextDelta, TextDeltas, TokenBatch, TokenItem, decode, encode  # noqa: E402

REPLY_TO = "streamserve:reply:ingress-vm-8877-024b0d"
VOCAB = 49152


def publish(requests: int, tokens: int) -> tuple[TokenBatch, ProgressEntry, TextDeltas]:
    rng = random.Random(0)
    items, segments, deltas = [], {}, []
    for _ in range(requests):
        rid = f"chatcmpl-{uuid.UUID(int=rng.getrandbits(128)).hex}-0"
        ids = [rng.randrange(VOCAB) for _ in range(tokens)]
        context = [rng.randrange(VOCAB) for _ in range(8)]
        items.append(TokenItem(rid, REPLY_TO, 60, ids, context, 0, bundle=True))
        segments[rid] = ProgressEntry.segment(60, ids)
        deltas.append(TextDelta(rid, 60, ids, " a few words of text"[: 4 * tokens]))
    return (
        TokenBatch("vm-13c104", 7, items),
        ProgressEntry("vm-13c104", segments),
        TextDeltas(deltas),
    )


def per_token_us(work: Callable[[], object], repeats: int, tokens: int) -> float:
    started = time.process_time()
    for _ in range(repeats):
        work()
    return round((time.process_time() - started) / repeats / tokens * 1e6, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=5, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    batch, progress, deltas = publish(args.requests, args.tokens)
    written = {"tokens": encode(batch), "progress": encode(progress), "deltas": encode(deltas)}
    total = args.requests * args.tokens

    def timed(work: Callable[[], object]) -> float:
        return per_token_us(work, args.repeats, total)

    row = {
        "benchmark": "wire-codec",
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "bytes": {name: len(payload) for name, payload in written.items()},
        "bytes_per_token": round(sum(map(len, written.values())) / total, 1),
        "cpu_us_per_token": {
            "worker_encode": timed(lambda: (encode(batch), encode(progress))),
            "detokenizer_decode": timed(lambda: decode(written["tokens"], TokenBatch)),
            "detokenizer_encode": timed(lambda: encode(deltas)),
            "ingress_decode": timed(lambda: decode(written["deltas"], TextDelta, TextDeltas)),
        },
    }
    emit({**row, **jsonl.machine()}, args.out)


if __name__ == "__main__":
    main()
