"""The detokenizer stage's own CPU per token, without Redis: a publish's TokenBatch decoded
and handled (incremental detokenization, the reply deltas built), as under load.

    python benchmarks/bench_detok_cpu.py [--model smollm2-135m-instruct] [--out f.jsonl]

26 batches of 64 requests x 5 tokens (a synthetic worker's publishes at 10 ms steps and a
50 ms interval: benchmarks/bench_bus_load.py's fleet), handled by `DetokenizerStage.handle`;
the best of 10 rounds of CPU time (``process_time``: every thread of the process, so a
library's thread pool counts). Also the TokenBatch decode alone, one tokenizer decode, and a
plain Python loop, to tell a slower host from a slower path. One JSON line.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tokenizers  # noqa: E402

from benchmarks.jsonl import emit, machine  # noqa: E402
from bus.actor import Inbound  # noqa: E402
from jobs.model_tokenizer import load_model_tokenizer  # noqa: E402
from jobs.protocol import TokenBatch, TokenItem, decode, encode  # noqa: E402
from runtime.config import BusConfig  # noqa: E402
from stages.detokenizer.stage import DetokenizerStage  # noqa: E402

PUBLISHES, REQUESTS, TOKENS = 26, 64, 5


def _payloads() -> list[bytes]:
    payloads = []
    for step in range(PUBLISHES):
        items = [TokenItem(f"cmpl-{r:032x}", "streamserve:reply:ingress-x", step * TOKENS,
                           [6000 + (r * 7 + step * TOKENS + k) % 20000 for k in range(TOKENS)],
                           [], 0, bundle=True)
                 for r in range(REQUESTS)]  # fmt: skip
        payloads.append(encode(TokenBatch("w1", step, items)))
    return payloads


def _cpu(run) -> float:
    started = time.process_time()
    run()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, help="also append the JSON line to this file")
    args = parser.parse_args()
    tokenizer = load_model_tokenizer(args.model)
    stage = DetokenizerStage(BusConfig(), tokenizer)
    payloads = _payloads()
    tokens = PUBLISHES * REQUESTS * TOKENS

    def handle() -> None:  # a new stage each round: every request starts afresh
        fresh = DetokenizerStage(BusConfig(), tokenizer)
        for i, payload in enumerate(payloads):
            fresh.handle([Inbound(b"%d-0" % i, decode(payload, TokenBatch))])

    def decode_all() -> None:
        for payload in payloads:
            decode(payload, TokenBatch)

    def one_decode() -> None:
        for _ in range(10_000):
            tokenizer.decode([6000, 6001, 6002, 6003, 6004])

    def loop() -> None:
        total = 0
        for i in range(2_000_000):
            total += i * i

    del stage
    for _ in range(3):
        handle()
    row = {
        "benchmark": "detok-cpu",
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "detok_us_per_token": round(1e6 * min(_cpu(handle) for _ in range(10)) / tokens, 3),
        "decode_us_per_token": round(1e6 * min(_cpu(decode_all) for _ in range(10)) / tokens, 3),
        "tokenizer_decode_us": round(1e6 * _cpu(one_decode) / 10_000, 3),
        "python_loop_ms": round(1e3 * _cpu(loop), 1),
    }
    emit({**row, **machine(), "model": args.model}, args.out)


if __name__ == "__main__":
    main()
