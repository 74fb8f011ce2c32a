"""A tensor-parallel worker on the bus: `python -m gpu_worker --tp 2` serves a job as a
single-rank worker does (rank 0 alone talks to the bus), stops cleanly on SIGTERM, and exits
as one when its follower dies, so its heartbeat lapses and its jobs can migrate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_worker import Engine
from gpu_worker.parallel.launch import EXIT_RANK_DIED
from jobs.protocol import ENTRY_FIELD, TokenBatch, TokenizedRequest, decode, encode
from runtime.config import BusConfig
from tests.worker_thread import published_entries

MODEL = "random:micro-llama"
PROMPT = [3, 4, 5, 6, 7]
JOB = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0.0}


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _follower_pids(pid: int) -> list[int]:
    """The tp followers among `pid`'s children (spawned interpreters, not the resource
    tracker multiprocessing may start beside them)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    followers = []
    for child in map(int, children):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            followers.append(child)
    return followers


@pytest.fixture
def tp_worker(redis_url, redis_client):
    command = [sys.executable, "-m", "gpu_worker", "--redis-url", redis_url, "--model", MODEL,
               "--worker-id", "tpw", "--tp", "2", "--dtype", "float32",
               "--max-total-tokens", "2048"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    config = BusConfig(redis_url=redis_url)
    try:
        beating = config.heartbeat_key("tpw")
        _wait(lambda: redis_client.exists(beating) or process.poll() is not None)
        assert process.poll() is None, process.stderr.read()
        yield process, config
    finally:
        process.kill()
        process.wait()


def test_a_tp2_worker_serves_a_job_as_one_rank_does(tp_worker, redis_client):
    process, config = tp_worker
    expected = Engine(MODEL, dtype="float32").generate(input_ids=PROMPT, sampling_params=JOB)
    job = TokenizedRequest("r1", "t:reply", PROMPT, JOB)
    redis_client.xadd(config.worker_stream("tpw"), {ENTRY_FIELD: encode(job)})

    def items():
        for _, fields in published_entries(redis_client, config):
            yield from decode(fields[ENTRY_FIELD], TokenBatch).items

    _wait(lambda: any(item.finish for item in items()))
    assert [i for item in items() for i in item.ids] == expected["output_ids"]
    followers = _follower_pids(process.pid)
    assert len(followers) == 1
    process.send_signal(signal.SIGTERM)  # as `streamserve up` stops a worker
    assert process.wait(timeout=30) == 0
    _wait(lambda: not Path(f"/proc/{followers[0]}").exists(), timeout=30)


def test_a_tp2_worker_whose_follower_dies_exits_as_one(tp_worker, redis_client):
    process, config = tp_worker
    (follower,) = _follower_pids(process.pid)
    os.kill(follower, signal.SIGKILL)
    assert process.wait(timeout=30) == EXIT_RANK_DIED
    assert "tp-rank-1 died" in process.stderr.read()
    # No more beats: the key expires, and the reaper then moves the worker's jobs elsewhere.
    key = config.heartbeat_key("tpw")
    _wait(lambda: not redis_client.exists(key), timeout=config.heartbeat_ttl_s + 10)


@pytest.mark.slow
def test_streamserve_up_tp2_answers_as_transformers(hf_default_model):
    from gpu_worker.hf_reference import hf_greedy
    from tests.pipeline_harness import Pipeline

    prompts = [[1, 504, 3458, 314, 4649, 282], list(range(200, 260))]
    expected = hf_greedy(hf_default_model, prompts, max_new_tokens=12, stop_at_eos=False)
    with Pipeline("smollm2-135m-instruct", worker_arg=["--dtype=float32"], tp=2) as pipeline:
        for prompt, want in zip(prompts, expected, strict=True):
            sampling = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
            status, body = pipeline.post(
                "/generate", {"input_ids": prompt, "sampling_params": sampling}
            )
            assert status == 200, body
            assert body["output_ids"] == want
        assert len(pipeline.replica_pids("gpu_worker")) == 1  # one worker, its follower below it
