"""A stage or worker given SIGTERM while it waits for work stops at once, not when its
blocked read times out: each is started with reads that block for 30 s, and must be gone,
its goodbye said, within two seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import redis

from cli.worker_command import worker_command
from runtime.config import BusConfig
from stages.router.stage import live_workers
from tests.worker_thread import wait_until

MODEL = "smollm2-135m-instruct"
BLOCK_ENV = {"STREAMSERVE_BLOCK_MS": "30000"}
STOP_WITHIN_S = 2.0  # against the 30 s a read blocks (it took 4.5-30 s before)


def _start(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, env={**os.environ, **BLOCK_ENV}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _stopped_within(process: subprocess.Popen[bytes]) -> float:
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("it waited for its read") from None
    return time.monotonic() - start


def test_a_stage_waiting_for_entries_stops_at_once(redis_url):
    config = BusConfig(redis_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    stage = _start([sys.executable, "-m", "cli", "stage", "detokenizer", "--model", MODEL,
                    "--redis-url", redis_url])  # fmt: skip
    stream = config.tokens_stream()
    wait_until(lambda: client.exists(stream) and client.xinfo_groups(stream))
    wait_until(lambda: client.xinfo_consumers(stream, "detokenizer"))
    time.sleep(0.5)  # into its blocked read
    _stopped_within(stage)
    assert stage.returncode == 0, stage.stderr.read().decode()[-2000:]
    assert b"stopping after the current batch" in stage.stderr.read()


def test_a_worker_waiting_for_jobs_stops_at_once_and_says_goodbye(redis_url):
    config = BusConfig(redis_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    worker = _start(worker_command(redis_url, MODEL, ["--worker-id", "w-stop", "--synthetic"]))
    wait_until(lambda: [w for w in live_workers(client, config) if w.worker_id == "w-stop"])
    time.sleep(0.5)  # its intake into a blocked read, its loop waiting on the intake
    _stopped_within(worker)
    assert worker.returncode == 0, worker.stderr.read().decode()[-2000:]
    assert not live_workers(client, config)  # its heartbeat gone: the goodbye was said
