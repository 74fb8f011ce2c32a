"""Priority classes and fair share in the worker: the waiting queue serves lower `priority`
values first, and a request that cannot be admitted for want of a batch slot or of KV
retracts running requests of a lower class (batch lines), which run again later to the same
greedy output. Within a class, tenants (API keys) share the admissions by weight: one that
floods the queue does not keep another's request waiting behind it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_worker import Engine
from gpu_worker.hf_reference import hf_greedy
from gpu_worker.scheduling.policy import order_waiting
from jobs.sampling_params import SamplingParams

MAX_NEW = 24
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers.", "What is 17 times 23?"]


def fake(name: str, priority: int, tenant: str = "", tag: float = 0.0):
    # The scheduler's fields sit on the request beside its sampling parameters.
    return SimpleNamespace(name=name, priority=priority, tenant=tenant, fair_tag=tag)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_waiting_requests_are_served_by_class_then_in_their_policys_order(policy):
    waiting = [fake("b1", 1), fake("i1", 0), fake("b2", 1), fake("i2", 0), fake("u", -1)]
    ordered = order_waiting(waiting, policy, lambda req: 0)
    assert [r.name for r in ordered] == ["u", "i1", "i2", "b1", "b2"]


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    texts = [default_tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                   tokenize=False, add_generation_prompt=True)
             for q in PROMPTS]  # fmt: skip
    return [default_tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.fixture(scope="module")
def reference(hf_default_model, prompts) -> list[list[int]]:
    return hf_greedy(hf_default_model, prompts, MAX_NEW, stop_at_eos=False)


def _run_until_done(engine: Engine, reqs) -> None:
    while not all(req.finished for req in reqs):
        engine.scheduler.step()


def _req(engine: Engine, rid: str, ids: list[int], priority: int):
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True,
                            priority=priority)  # fmt: skip
    return engine.build_request(rid, ids, params)


def test_an_interactive_request_takes_a_batch_lines_slot_and_both_keep_their_output(
    prompts, reference
):
    engine = Engine("smollm2-135m-instruct", dtype="float32", max_running_requests=2)
    batch = [_req(engine, f"batch-{i}", prompts[i], priority=1) for i in (0, 1)]
    for req in batch:
        engine.scheduler.add_request(req)
    for _ in range(4):  # both batch lines prefilled and decoding: no free slot
        engine.scheduler.step()
    assert len(engine.scheduler.running) == 2
    interactive = _req(engine, "interactive", prompts[2], priority=0)
    engine.scheduler.add_request(interactive)
    engine.scheduler.step()
    assert interactive in engine.scheduler.running, "it waited for a batch line to finish"
    assert engine.scheduler.num_retractions == 1
    _run_until_done(engine, [interactive, *batch])
    assert [r.output_ids for r in (*batch, interactive)] == reference


def test_kv_short_for_an_interactive_request_retracts_batch_lines_never_it(prompts, reference):
    longest = max(len(p) for p in prompts) + MAX_NEW
    page = 16
    pool = (-(-longest // page) + 1) * page  # one whole request and a page more
    engine = Engine("smollm2-135m-instruct", dtype="float32", max_total_tokens=pool,
                    page_size=page)  # fmt: skip
    line = _req(engine, "batch", prompts[0], priority=1)
    engine.scheduler.add_request(line)
    for _ in range(2):
        engine.scheduler.step()
    interactive = _req(engine, "interactive", prompts[2], priority=0)
    engine.scheduler.add_request(interactive)
    engine.scheduler.step()
    assert interactive in engine.scheduler.running and line not in engine.scheduler.running
    while not interactive.finished:  # the batch line may come back, and goes again
        assert interactive in engine.scheduler.running
        engine.scheduler.step()
    _run_until_done(engine, [line])
    assert engine.scheduler.num_retractions >= 1
    assert [line.output_ids, interactive.output_ids] == [reference[0], reference[2]]


def test_requests_of_one_class_do_not_retract_each_other_to_be_admitted(prompts):
    engine = Engine("smollm2-135m-instruct", dtype="float32", max_running_requests=1)
    first = _req(engine, "first", prompts[0], priority=0)
    engine.scheduler.add_request(first)
    engine.scheduler.step()
    engine.scheduler.add_request(_req(engine, "second", prompts[1], priority=0))
    engine.scheduler.step()
    assert engine.scheduler.running == [first] and engine.scheduler.num_retractions == 0


def test_a_flooding_tenant_does_not_keep_another_tenants_request_waiting(prompts):
    engine = Engine("smollm2-135m-instruct", dtype="float32", max_running_requests=2)
    scheduler = engine.scheduler
    flood = []
    for i in range(8):
        req = _req(engine, f"a-{i}", prompts[i % 2], priority=0)
        req.tenant = "a"
        flood.append(req)
        scheduler.add_request(req)
    scheduler.step()  # two of the flood run, six wait
    other = _req(engine, "b-0", prompts[2], priority=0)
    other.tenant = "b"
    scheduler.add_request(other)
    while other not in scheduler.running:
        assert not other.finished
        scheduler.step()
    started_before = [r.rid for r in flood if r.finished or r in scheduler.running]
    assert len(started_before) <= 3, f"b waited behind {started_before}"


def test_a_tenants_weight_is_its_share_of_the_admissions():
    from gpu_worker.scheduling.fair_share import FairShare
    from gpu_worker.scheduling.req import Req
    from jobs.sampling_params import SamplingParams as Params

    share = FairShare()
    waiting = []
    for tenant, weight in (("light", 1.0), ("heavy", 2.0)):
        for i in range(6):
            req = Req(f"{tenant}-{i}", [1] * 10, Params(max_new_tokens=10), frozenset())
            req.tenant, req.weight = tenant, weight
            share.tag(req)
            waiting.append(req)
    first_six = [r.tenant for r in order_waiting(waiting, "fcfs", lambda r: 0)[:6]]
    assert first_six.count("heavy") == 4 and first_six.count("light") == 2
