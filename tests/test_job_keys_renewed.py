"""A job that runs longer than the keys' TTL keeps what it needs to resume: its progress is on
the worker's log, which has no TTL (the reaper deletes it with the worker). No key of its own
needs renewing: where it runs is not recorded (an abort is a flag its worker reads,
bus/aborts.py)."""

from __future__ import annotations

import threading
import time

from bus.fence_off import read_progress_log
from gpu_worker import Engine
from gpu_worker.worker import Worker
from jobs.progress import rebuild
from jobs.protocol import ENTRY_FIELD, TokenizedRequest, encode
from runtime.config import BusConfig

MODEL = "random:tiny-llama"
SLOW = {
    "name": "slow",
    "target_modules": "lm_head",
    "hook_factory": "tests.hook_factories.slow_down",
    "config": {"seconds": 0.02},
}
MAX_NEW = 150  # about 3 s at 20 ms a step: three times the TTL


def test_a_job_longer_than_the_ttl_keeps_its_progress(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, block_ms=20, reply_ttl_s=1)
    worker = Worker(Engine(MODEL, dtype="float32", forward_hooks=[SLOW]), redis_client, config,
                    "w", MODEL)  # fmt: skip
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    rid = "long"
    job = TokenizedRequest(rid, "t:reply", [5, 17, 99], {"max_new_tokens": MAX_NEW,
                                                          "ignore_eos": True})  # fmt: skip
    redis_client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})
    try:
        seen, seen_late = [], []
        started = time.monotonic()
        deadline = started + 2.5  # well past the 1 s TTL
        while time.monotonic() < deadline:
            produced = rebuild(read_progress_log(redis_client, config, "w"), {rid: []})[rid]
            if produced:
                seen.append(len(produced))
                if time.monotonic() - started > 1.5 * config.reply_ttl_s:
                    seen_late.append(len(produced))
            time.sleep(0.05)
        assert seen and max(seen) < MAX_NEW, "the job ended too soon to say anything"
        assert seen == sorted(seen) and max(seen) > 1  # the log kept all of it, growing
        assert seen_late, "nothing rebuilt from the log once the TTL had passed"
    finally:
        worker.stop.set()
        thread.join(timeout=30)
