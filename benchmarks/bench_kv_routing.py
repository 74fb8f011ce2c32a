"""KV-aware routing against load-only routing: a multi-turn chat workload through the whole
pipeline with several workers, each policy in the same run.

    python benchmarks/bench_kv_routing.py [--workers 2] [--conversations 16] [--turns 4]
        [--system-prompts 3] [--system-tokens 512] [--out f.jsonl] [--requests-out r.jsonl]

Each conversation opens with one of a few shared system prompts; each turn carries the
whole history (the previous turn's prompt and answer, as token ids, so a cache holding them
matches exactly) and a new user message. Conversations run concurrently, each turn after the
previous one's answer and a think time (uniform in ``[0, --think-ms]``, the same draws for
every policy: without it the turns arrive in lockstep and load-only routing happens to send
each conversation back to the same worker). Every policy gets a fresh ``streamserve up``
(empty caches) and runs, each once all ``--workers`` beat idle (`wait_for_idle_workers`):

- ``shared``: the workload over ``--system-prompts`` system prompts;
- ``hot``: then every conversation opens with one new system prompt (a hot prefix).

Figures per (policy, workload): TTFT p50/p90 (submit to first token), output tok/s over the
workload, cached tokens (the workers' own count, each Finish's) against what one worker
holding everything would have reused (`ideal_cached`: each request's longest prefix shared
with a prompt sent, or a prompt and answer finished, before it), and the prompt tokens each
worker got (``max_worker_token_ratio``: the busiest over the least busy). Targets (issue 28):
cached >= 0.9x ideal, TTFT p50 <= 0.6x load-only, output tok/s no lower, hot ratio <= 1.5.
One worker reaches the ideal exactly (``--workers 1``: 1.000 on both workloads).

``--requests-out`` appends one JSON line per request (policy, workload, conversation, turn,
system prompt, worker, the router's ``route_reason`` and ``expected_cached``, the worker's
``cached`` and the request's ``ideal_cached``): where the cached tokens missing against the
ideal went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402
from bench_pipeline import started_pipeline  # noqa: E402

from benchmarks.jsonl import emit, machine  # noqa: E402
from bus.client import AsyncClient  # noqa: E402
from bus.liveness import read_liveness  # noqa: E402
from runtime.config import BusConfig  # noqa: E402

VOCAB = (1_000, 40_000)  # ordinary token ids of the default model's vocabulary
USER_TOKENS = 32
WORKERS_TIMEOUT_S = 300.0


class Conversation:
    def __init__(self, number: int, system: int, ids: list[int], rng: random.Random) -> None:
        self.number, self.system = number, system
        self.history = list(ids)
        self.rng = rng
        self.turns = 0

    def next_prompt(self) -> list[int]:
        return self.history + [self.rng.randrange(*VOCAB) for _ in range(USER_TOKENS)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


async def run_workload(client: AsyncClient, systems: list[list[int]],
                       args: argparse.Namespace, seed: int) -> dict:  # fmt: skip
    rng = random.Random(seed)
    conversations = [Conversation(i, i % len(systems), systems[i % len(systems)],
                                  random.Random(rng.random()))
                     for i in range(args.conversations)]  # fmt: skip
    # What one cache holding everything would hold: every prompt sent, every answer.
    finished: list[list[int]] = []
    ttfts, cached, ideal, per_worker, outputs = [], 0, 0, {}, 0
    requests: list[dict] = []  # one record per request, for --requests-out
    sampling = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "temperature": 0.0}

    began = time.perf_counter()

    async def turn(conversation: Conversation) -> None:
        nonlocal cached, ideal, outputs
        prompt = conversation.next_prompt()
        best = max((_common_prefix(prompt, seq) for seq in finished), default=0)
        ideal_here = min(best, len(prompt) - 1)
        ideal += ideal_here
        finished.append(prompt)  # cached once prefilled, before its answer comes
        started = time.perf_counter()
        rid = await client.submit(input_ids=prompt, sampling=sampling)
        first, ids, usage = None, [], None
        async for chunk in client.stream(rid):
            if first is None and chunk["output_ids"]:
                first = time.perf_counter() - started
            ids += chunk["output_ids"]
            usage = chunk.get("usage") or usage
        ttfts.append(first)
        outputs += len(ids)
        usage = usage or {}
        cached += usage.get("cached_tokens", 0)
        worker = usage.get("worker", "?")  # the worker that finished it (its Finish)
        per_worker[worker] = per_worker.get(worker, 0) + len(prompt)
        requests.append({
            "conversation": conversation.number, "turn": conversation.turns,
            "system": conversation.system, "worker": worker, "prompt_tokens": len(prompt),
            "route_reason": usage.get("route_reason"),
            "expected_cached": usage.get("expected_cached_tokens"),
            "cached": usage.get("cached_tokens", 0), "ideal_cached": ideal_here,
            "submitted_s": round(started - began, 3), "ttft_ms": round(1000 * first, 1),
        })  # fmt: skip
        conversation.turns += 1
        conversation.history = prompt + ids
        finished.append(prompt + ids[:-1])  # the last token's KV is never computed

    async def talk(conversation: Conversation) -> None:
        for index in range(args.turns):
            if index:
                await asyncio.sleep(conversation.rng.uniform(0, args.think_ms) / 1000)
            await turn(conversation)

    await asyncio.gather(*(talk(c) for c in conversations))
    wall = time.perf_counter() - began
    loads = sorted(per_worker.values())
    return {
        "requests": len(ttfts), "wall_s": round(wall, 2),
        "ttft_ms_p50": round(1000 * statistics.median(ttfts), 1),
        "ttft_ms_p90": round(1000 * statistics.quantiles(ttfts, n=10)[-1], 1),
        "output_tok_s": round(outputs / wall, 2),
        "cached_tokens": cached, "ideal_cached": ideal,
        "cached_vs_ideal": round(cached / ideal, 3) if ideal else None,
        "worker_prompt_tokens": dict(sorted(per_worker.items())),
        "max_worker_token_ratio": round(loads[-1] / max(loads[0], 1), 2),
        "workers_used": len(loads),
        "requests_detail": sorted(requests, key=lambda r: r["submitted_s"]),
    }  # fmt: skip


def wait_for_idle_workers(bus: redis.Redis, config: BusConfig, count: int) -> None:
    """Until `count` workers beat, none with a job running or waiting: each workload starts
    on an idle fleet as the router sees it. `streamserve up` is healthy once one worker is:
    the others, still loading, would join in the middle of the workload, empty, and both
    policies would move conversations onto them (away from the caches holding their
    histories). And a heartbeat is up to an interval old: started at once after the previous
    workload, the next would find some workers still counted busy with its last jobs, and
    its first burst would pile onto the others."""
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while True:
        beats = read_liveness(bus, config).beats.values()
        if len(beats) >= count and all(beat.running + beat.waiting == 0 for beat in beats):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not {count} idle live workers after {WORKERS_TIMEOUT_S} s")
        time.sleep(0.1)


async def measure(args: argparse.Namespace, redis_url: str, seed: int) -> list[dict]:
    config = BusConfig(redis_url=redis_url)
    bus = redis.Redis.from_url(redis_url)
    rng = random.Random(seed)
    prompt = lambda: [rng.randrange(*VOCAB) for _ in range(args.system_tokens)]  # noqa: E731
    shared = [prompt() for _ in range(args.system_prompts)]
    hot = [prompt()]
    rows = []
    async with AsyncClient(redis_url) as client:
        wait_for_idle_workers(bus, config, args.workers)
        # Warm-up on ids no workload uses: first-request costs are not the router's.
        warm = [rng.randrange(*VOCAB) for _ in range(64)]
        await asyncio.gather(*(client.generate(input_ids=warm[i:], sampling={"max_new_tokens": 2})
                               for i in range(2 * args.workers)))  # fmt: skip
        for name, systems in (("shared", shared), ("hot", hot)):
            wait_for_idle_workers(bus, config, args.workers)
            row = await run_workload(client, systems, args, seed + len(rows))
            rows.append({"workload": name, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--think-ms", type=float, default=200.0)
    parser.add_argument("--policies", default="load,kv")
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--requests-out", type=Path,
                        help="also write one JSON line per request: conversation, turn, "
                             "system prompt, worker, route reason, expected and actual "
                             "cached tokens, ideal cached tokens")  # fmt: skip
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    for policy in args.policies.split(","):
        env = {**os.environ, "STREAMSERVE_ROUTER_POLICY": policy}
        up_args = ["--workers", str(args.workers)]
        with started_pipeline(args, env=env, log_level="WARNING", up_args=up_args) as (_, url):
            results[policy] = asyncio.run(measure(args, url, args.seed))
    base = {row["workload"]: row for row in results.get("load", [])}
    for policy, rows in results.items():
        for row in rows:
            detail = row.pop("requests_detail")
            if args.requests_out is not None:
                with args.requests_out.open("a") as out:
                    head = {"policy": policy, "workers": args.workers, "workload": row["workload"]}
                    out.writelines(json.dumps({**head, **record}) + "\n" for record in detail)
            reference = base.get(row["workload"])
            if reference is not None and policy != "load":
                row["ttft_p50_vs_load"] = round(row["ttft_ms_p50"] / reference["ttft_ms_p50"], 3)
                row["output_tok_s_vs_load"] = round(
                    row["output_tok_s"] / reference["output_tok_s"], 3
                )
            emit({"bench": "kv_routing", "policy": policy, "workers": args.workers,
                  "conversations": args.conversations, "turns": args.turns,
                  "system_prompts": args.system_prompts if row["workload"] == "shared" else 1,
                  "system_tokens": args.system_tokens, "max_new_tokens": args.max_new_tokens,
                  "think_ms": args.think_ms,
                  "model": args.model, **row, **machine()}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
