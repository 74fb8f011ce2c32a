"""What a batch and a flooding key cost interactive users: TTFT p50 of one key's streamed chat
requests on an idle system, while a batch runs, and while another key floods the API.

    python benchmarks/bench_batch_priority.py [--lines 1000] [--probes 20] [--flood 64]
        [--max-concurrent 16] [--out f.jsonl]

One `streamserve up` (float32, its own embedded Redis) with two API keys, each its own
tenant with `--max-concurrent` requests at most (STREAMSERVE_KEY_LIMITS). Phases, in turn:
`idle` (the probes alone); `batch` (a `--lines`-line completions batch made with the flood
key, the second, probed once it is in progress, then waited for to its end: it must finish);
`flood` (the flood key keeps `--flood` streams going, each retrying after its 429s as
Retry-After says, while the interactive key, the first, probes). Probes go one at a time, a
short pause apart. Targets (the Batch issue): TTFT p50 during the batch and during the flood
<= 1.5x idle. One JSON line per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline import started_pipeline  # noqa: E402

from benchmarks import jsonl  # noqa: E402
from benchmarks.jsonl import emit  # noqa: E402

PROBER, FLOODER = "sk-bench-interactive", "sk-bench-flood"
PROBE_GAP_S = 0.3


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


async def probe_ttfts(url: str, count: int, max_tokens: int) -> list[float]:
    """TTFT (ms) of `count` streamed chat requests of the interactive key, one at a time."""
    api = client(url, PROBER)
    ttfts = []
    for i in range(count):
        started = time.perf_counter()
        stream = await api.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=max_tokens, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"Probe {i}: name a colour."}],
        )  # fmt: skip
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        ttfts.append(1000 * ((first or time.perf_counter()) - started))
        await asyncio.sleep(PROBE_GAP_S)
    return ttfts


def batch_file(lines: int, max_tokens: int) -> bytes:
    rows = []
    for i in range(lines):
        body = {"model": "smollm2-135m-instruct", "prompt": f"Line {i}: a short story about",
                "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
        rows.append(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}))  # fmt: skip
    return "\n".join(rows).encode()


async def batch_phase(url: str, args: argparse.Namespace, idle_p50: float) -> dict:
    api = client(url, FLOODER)
    upload = await api.files.create(file=("b.jsonl", io.BytesIO(batch_file(args.lines, 16))),
                                    purpose="batch")  # fmt: skip
    started = time.perf_counter()
    batch = await api.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                     completion_window="24h")  # fmt: skip
    while (await api.batches.retrieve(batch.id)).request_counts.completed < 20:
        await asyncio.sleep(0.2)
    ttfts = await probe_ttfts(url, args.probes, args.max_tokens)
    done_during = (await api.batches.retrieve(batch.id)).request_counts.completed
    while (state := await api.batches.retrieve(batch.id)).status not in (
        "completed", "failed", "cancelled", "expired"
    ):  # fmt: skip
        await asyncio.sleep(0.5)
    wall = time.perf_counter() - started
    p50 = statistics.median(ttfts)
    return {"phase": "batch", "ttft_ms_p50": round(p50, 1), "vs_idle": round(p50 / idle_p50, 2),
            "batch_status": state.status, "batch_lines": args.lines,
            "batch_completed": state.request_counts.completed,
            "lines_done_while_probing": done_during, "batch_wall_s": round(wall, 1),
            "batch_lines_per_s": round(args.lines / wall, 1)}  # fmt: skip


async def flood_phase(url: str, args: argparse.Namespace, idle_p50: float) -> dict:
    api = client(url, FLOODER)
    stop = asyncio.Event()
    refused = served = 0

    async def flooder(n: int) -> None:
        nonlocal refused, served
        while not stop.is_set():
            try:
                stream = await api.completions.create(
                    model="smollm2-135m-instruct", prompt=f"Flood {n}: once upon a time",
                    max_tokens=64, stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                async for _ in stream:
                    pass
                served += 1
            except openai.RateLimitError as exc:
                refused += 1  # a client that waits as told, as the official ones do
                await asyncio.sleep(float(exc.response.headers.get("Retry-After", "1")))

    tasks = [asyncio.create_task(flooder(n)) for n in range(args.flood)]
    await asyncio.sleep(3)  # the flood at its height
    ttfts = await probe_ttfts(url, args.probes, args.max_tokens)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    p50 = statistics.median(ttfts)
    return {"phase": "flood", "ttft_ms_p50": round(p50, 1), "vs_idle": round(p50 / idle_p50, 2),
            "flood_streams": args.flood, "flood_served": served, "flood_429s": refused}  # fmt: skip


async def run(url: str, args: argparse.Namespace) -> list[dict]:
    await probe_ttfts(url, 3, args.max_tokens)  # warm-up
    idle = await probe_ttfts(url, args.probes, args.max_tokens)
    idle_p50 = statistics.median(idle)
    rows = [{"phase": "idle", "ttft_ms_p50": round(idle_p50, 1)}]
    if "batch" in args.phases:
        rows.append(await batch_phase(url, args, idle_p50))
    if "flood" in args.phases:
        rows.append(await flood_phase(url, args, idle_p50))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16, help="of each probe")
    parser.add_argument("--flood", type=int, default=64, help="concurrent flooding streams")
    parser.add_argument("--max-concurrent", type=int, default=16, help="per key")
    parser.add_argument("--batch-concurrency", type=int, default=None,
                        help="STREAMSERVE_BATCH_CONCURRENCY (default: the system's)")  # fmt: skip
    parser.add_argument("--phases", default="batch,flood", help="after idle, which to run")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    limits = {"keys": {key: {"name": name, "max_concurrent": args.max_concurrent}
                       for key, name in ((PROBER, "interactive"), (FLOODER, "flood"))}}  # fmt: skip
    env = {"STREAMSERVE_API_KEY": f"{PROBER},{FLOODER}",
           "STREAMSERVE_KEY_LIMITS": json.dumps(limits)}  # fmt: skip
    if args.batch_concurrency is not None:
        env["STREAMSERVE_BATCH_CONCURRENCY"] = str(args.batch_concurrency)
    with started_pipeline(args, {**os.environ, **env}, log_level="WARNING") as (url, _):
        rows = asyncio.run(run(url, args))
    machine = {**jsonl.machine(), "model": args.model, "dtype": args.dtype,
               "max_concurrent_per_key": args.max_concurrent}  # fmt: skip
    for row in rows:
        emit({**row, **machine}, args.out)


if __name__ == "__main__":
    main()
