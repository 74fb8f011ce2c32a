"""The synthetic worker (gpu_worker/synthetic_engine.py): no model, tokens at a set rate.

Its scheduler alone (batch cap, finishes, deterministic ids, resume, abort), then a worker
started with --synthetic in a whole running system, served through the real stages; and
that a worker is never synthetic unless told, nor imports torch when it is."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from gpu_worker import cli
from gpu_worker.synthetic_engine import SyntheticEngine, synthetic_token
from jobs.field_error import FieldError
from tests.pipeline_harness import Pipeline

MODEL = "smollm2-135m-instruct"
SYNTHETIC = ["--synthetic", "--synthetic-step-ms=5", "--synthetic-batch=4"]


def engine(batch: int = 4, step_ms: float = 1.0) -> SyntheticEngine:
    return SyntheticEngine(MODEL, step_ms=step_ms, batch=batch)


def request(e: SyntheticEngine, rid: str, max_tokens: int, **sampling):
    params = e.sampling_params({"max_new_tokens": max_tokens, **sampling}, 3)
    return e.build_request(rid, [5, 6, 7], params, detokenize=False)


def run_to_end(e: SyntheticEngine) -> list[int]:
    """Step until idle; the number of requests each step gave a token."""
    sizes = []
    while e.scheduler.has_work():
        sizes.append(len(e.scheduler.step()))
    return sizes


def test_each_step_serves_at_most_batch_requests_one_token_each_and_ends_at_max_tokens():
    e = engine(batch=4)
    reqs = [request(e, f"r{i}", 3) for i in range(10)]
    for req in reqs:
        e.scheduler.add_request(req)
    sizes = run_to_end(e)
    assert max(sizes) == 4 and sum(sizes) == 30  # 10 requests x 3 tokens, 4 at a time
    for req in reqs:
        assert len(req.output_ids) == 3 and req.finished_reason.kind == "length"
        assert req.output_ids == [synthetic_token(req.rid, i, e.facts) for i in range(3)]
        assert all(0 <= t < e.vocab_size and t not in e.eos_ids for t in req.output_ids)
    assert e.scheduler.load()["free_kv_tokens"] == e.runner.max_total_tokens


def test_ids_depend_on_request_and_position_so_a_resumed_request_continues_its_sequence():
    e = engine()
    whole = request(e, "job-1", 6)
    e.scheduler.add_request(whole)
    run_to_end(e)
    params = e.sampling_params({"max_new_tokens": 6}, 3)
    resumed = e.build_request("job-1", [5, 6, 7], params, False, output_ids=whole.output_ids[:2])
    e.scheduler.add_request(resumed)
    run_to_end(e)
    assert resumed.output_ids == whole.output_ids
    other = request(e, "job-2", 6)
    e.scheduler.add_request(other)
    run_to_end(e)
    assert other.output_ids != whole.output_ids


def test_a_step_lasts_step_ms():
    e = engine(step_ms=20)
    e.scheduler.add_request(request(e, "r", 3))
    started = time.perf_counter()
    run_to_end(e)
    assert time.perf_counter() - started >= 0.06


def test_stop_token_ids_abort_and_logprobs_end_and_report_as_the_real_scheduler_does():
    e = engine()
    first = synthetic_token("s", 1, e.facts)
    stopped = request(e, "s", 10, stop_token_ids=[first], logprobs=True, top_logprobs=1)
    aborted = request(e, "a", 10)
    for req in (stopped, aborted):
        e.scheduler.add_request(req)
    e.scheduler.step()
    assert e.scheduler.abort_request("a") is aborted
    assert aborted.finished_reason.kind == "abort" and len(aborted.output_ids) == 1
    run_to_end(e)
    assert stopped.finished_reason.kind == "stop" and stopped.finished_reason.matched == first
    assert stopped.logprobs == [0.0, 0.0] and len(stopped.top_logprobs) == 2
    assert e.scheduler.abort_request("a") is None


def test_what_it_cannot_honour_is_the_requests_error_naming_its_field():
    e = engine()
    with pytest.raises(FieldError) as stop:
        request(e, "r", 4, stop=["x"])
    assert stop.value.field == "stop"
    with pytest.raises(FieldError) as grammar:
        request(e, "r", 4, regex="[a-z]+")
    assert grammar.value.field == "regex" and "synthetic" in str(grammar.value)
    with pytest.raises(FieldError):  # checked as the real engine checks
        e.build_request("r", [e.vocab_size], e.sampling_params({}, 1))


def test_a_worker_runs_the_model_unless_started_with_synthetic(monkeypatch):
    import gpu_worker.engine

    made = []

    class RecordingEngine:
        def __init__(self, model, **options):
            made.append(model)
            raise ValueError("recorded")  # the cli's clean exit for a bad engine option

    monkeypatch.setattr(gpu_worker.engine, "Engine", RecordingEngine)
    monkeypatch.setattr(cli, "attach_checked", lambda config, role: config)
    assert cli.main(["--redis-url", "redis://127.0.0.1:1", "--model", MODEL]) == 2
    assert made == [MODEL]
    # Its settings alone do not make a worker synthetic: they are refused, not ignored.
    argv = ["--redis-url", "redis://127.0.0.1:1", "--synthetic-batch", "8"]
    assert cli.main(argv) == 2 and made == [MODEL]


def test_a_synthetic_worker_imports_no_torch():
    code = (
        "import sys; from gpu_worker import cli, worker; "
        "from gpu_worker.synthetic_engine import SyntheticEngine; "
        f"SyntheticEngine({MODEL!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_synthetic_worker_serves_jobs_through_the_real_stages():
    with Pipeline(worker_arg=SYNTHETIC) as pipeline:
        for max_tokens in (1, 7):
            status, body = pipeline.post(
                "/generate",
                {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": max_tokens}},
            )
            assert status == 200, body
            meta = body["meta_info"]
            assert meta["finish_reason"] == "length" and meta["completion_tokens"] == max_tokens
            facts = SyntheticEngine(MODEL).facts
            expected = [synthetic_token(meta["id"], i, facts) for i in range(max_tokens)]
            assert body["output_ids"] == expected and body["text"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        status, body = pipeline.post("/v1/chat/completions", chat)
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 5
        status, body = pipeline.post("/v1/chat/completions", {**chat, "stop": ["x"]})
        assert status == 400 and body["error"]["param"] == "stop"
        with urllib.request.urlopen(pipeline.url + "/health", timeout=10) as reply:
            health = json.loads(reply.read())
        assert list(health["serving"].values()) == ["synthetic engine: no model"]
