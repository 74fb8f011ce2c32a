"""Redis dies and comes back empty (no persistence): every stage rides it out without being
restarted, /health says 503 meanwhile, and the system serves again once Redis is back.

Requests in flight when Redis dies are gone with it; their clients get a 503 rather than a
hang (the reply reader fails every waiting request when Redis cannot be read).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from tests.pipeline_harness import Pipeline

pytestmark = pytest.mark.slow

STAGES = ("gpu_worker", "stage ingress", "stage tokenizer", "stage router",
          "stage detokenizer")  # fmt: skip


def _health(pipeline: Pipeline) -> int:
    try:
        with urllib.request.urlopen(pipeline.url + "/health", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def _complete(pipeline: Pipeline) -> int:
    body = {"model": pipeline.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    return pipeline.post("/v1/completions", body, timeout=60)[0]


def test_every_stage_rides_out_a_redis_restart_and_serves_after_it():
    with Pipeline() as pipeline:
        assert _complete(pipeline) == 200
        pids = {stage: pipeline.replica_pids(stage) for stage in STAGES}

        pipeline.server.kill()
        time.sleep(1.0)
        assert _health(pipeline) == 503
        assert _complete(pipeline) == 503
        time.sleep(2.0)  # several reconnect attempts fail meanwhile
        pipeline.server.revive()

        deadline = time.monotonic() + 60
        while _health(pipeline) != 200 or _complete(pipeline) != 200:
            assert time.monotonic() < deadline, "not serving again after the restart"
            time.sleep(0.5)
        assert {stage: pipeline.replica_pids(stage) for stage in STAGES} == pids  # none died


def test_the_launchers_wait_for_workers_outlasts_a_redis_that_is_down():
    """`up` waits for every worker's first heartbeat after /health is 200: a Redis restart
    in that window ended the whole system with a ConnectionError (seen in this file's test
    above). Now the wait keeps polling: here, with nothing to revive it, until its deadline."""
    import argparse

    from cli.launcher import Launcher
    from runtime.config import BusConfig
    from runtime.embedded_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        url = server.url
        server.kill()
        launcher = Launcher(argparse.Namespace(workers=1, ready_timeout=1.0), BusConfig())
        started = time.monotonic()
        assert launcher._wait_for_workers(url) is False
        assert time.monotonic() - started >= 1.0
