"""The default admission order, spf (shortest prefill first, aged: scheduling/policy.py): a
burst's shortest prompts are prefilled first, so their first tokens come steps sooner; a
request yields only to those arriving before its own prefill could have been done, so later
short prompts never starve a long one; and the tokens are those of arrival order."""

from __future__ import annotations

import pytest

from gpu_worker import Engine
from gpu_worker.scheduling.policy import (
    DEFAULT_PREFILL_S_PER_TOKEN,
    SPF_PATIENCE,
    SPF_WINDOW,
    PrefillCost,
    order_waiting,
)
from gpu_worker.scheduling.req import Req
from jobs.sampling_params import SamplingParams

MODEL = "random:tiny-llama"


def _req(rid: str, tokens: int, arrived: float, priority: int = 0) -> Req:
    req = Req(rid, [1] * tokens, SamplingParams(max_new_tokens=4, priority=priority), frozenset())
    req.arrived = arrived
    return req


def _order(waiting: list[Req], per_token: float = 1e-3) -> list[str]:
    return [req.rid for req in order_waiting(waiting, "spf", lambda req: 0, per_token)]


def test_a_burst_goes_shortest_prompt_first():
    burst = [_req("300", 300, 5.0), _req("20", 20, 5.0), _req("150", 150, 5.0), _req("40", 40, 5.0)]
    assert _order(burst) == ["20", "40", "150", "300"]


def test_a_later_short_prompt_passes_a_long_one_only_within_its_patience():
    # 1,000 tokens at 1 ms a token: done alone after 1 s; passed for SPF_PATIENCE times that.
    wait = 1000 * 1e-3 * SPF_PATIENCE
    long = _req("long", 1000, 0.0)
    assert _order([long, _req("soon", 10, wait - 0.5)]) == ["soon", "long"]
    assert _order([long, _req("late", 10, wait + 0.1)]) == ["long", "late"]
    # However many arrive after that, the long one goes first.
    later = [_req(f"s{i}", 5, wait + 0.1 + i / 10) for i in range(50)]
    assert _order([*later, long])[0] == "long"


def test_a_deep_queue_sorts_only_its_oldest_window():
    waiting = [_req(f"r{i}", 500 - i % 400, float(i) / 1e6) for i in range(SPF_WINDOW + 100)]
    ordered = order_waiting(waiting, "spf", lambda req: 0, 1e-3)
    head, tail = ordered[:SPF_WINDOW], ordered[SPF_WINDOW:]
    assert [r.num_tokens for r in head] == sorted(r.num_tokens for r in head)
    assert tail == waiting[SPF_WINDOW:]


def test_priority_classes_still_come_first():
    waiting = [_req("short-batch", 5, 0.0, priority=1), _req("long-interactive", 900, 0.0)]
    assert _order(waiting) == ["long-interactive", "short-batch"]


def test_the_prefill_cost_is_weighted_by_tokens():
    cost = PrefillCost()
    assert cost.per_token == DEFAULT_PREFILL_S_PER_TOKEN
    cost.record(2048, 1.0)
    cost.record(4, 0.05)  # a few-token extend's fixed cost barely moves it
    assert cost.per_token == pytest.approx((0.9 + 0.05) / (2048 * 0.9 + 4), rel=1e-9)
    assert 4.5e-4 < cost.per_token < 5.5e-4


def _first_extend(policy: str) -> tuple[list[str], list[list[int]]]:
    engine = Engine(MODEL, dtype="float32", chunked_prefill_size=32, schedule_policy=policy)
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    reqs = [engine.build_request(f"{n}", list(range(3, 3 + n)), params) for n in (60, 10, 40, 20)]
    for req in reqs:
        engine.scheduler.add_request(req)
    engine.scheduler.step()
    first = sorted((req.rid for req in reqs if req.output_ids), key=int)
    while engine.scheduler.has_work():
        engine.scheduler.step()
    return first, [req.output_ids for req in reqs]


def test_the_engines_first_prefill_step_gives_the_short_prompts_their_first_tokens():
    spf_first, spf_tokens = _first_extend("spf")
    fcfs_first, fcfs_tokens = _first_extend("fcfs")
    assert (spf_first, fcfs_first) == (["10", "20"], [])  # fcfs: the 60 alone, chunked
    assert spf_tokens == fcfs_tokens


def test_a_workers_job_is_aged_from_its_arrival_in_the_system(redis_client, redis_url):
    """A job read while a long step ran is not new: spf counts its age from `created`
    (the ingress's clock), so it does not fall behind every request the worker had."""
    import time

    from gpu_worker.worker import Worker
    from jobs.protocol import ENTRY_FIELD, TokenizedRequest, encode
    from runtime.config import BusConfig

    engine = Engine(MODEL, dtype="float32")
    worker = Worker(engine, redis_client, BusConfig(redis_url=redis_url, block_ms=5), "a", MODEL)
    worker._inbox = worker.bus.open()
    now = time.time()
    for rid, created in (("waited", now - 20.0), ("fresh", now)):
        job = TokenizedRequest(rid, "t:replies", [1, 2, 3], {"max_new_tokens": 4}, created)
        redis_client.xadd(worker.bus.stream, {ENTRY_FIELD: encode(job)})
    for _ in range(200):
        worker._turn()
        if {"waited", "fresh"} <= set(worker.jobs):
            break
    waited, fresh = (worker.jobs[rid].req for rid in ("waited", "fresh"))
    assert 19.0 < fresh.arrived - waited.arrived < 21.0
