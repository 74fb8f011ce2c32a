"""What a token costs the bus: a worker publishes per interval, not per step, with its progress
logged for all its jobs in one entry; the detokenizer writes one entry per reply stream per
batch for the jobs that ask for bundles. Real workers (a small random model) on a real
server; the guarantees (no token repeated or missing, resume after a restart) hold."""

from __future__ import annotations

import threading

import pytest
import redis

from bus.actor import Actor, Inbound
from bus.effects import ExpireKey, Outbound
from bus.fence_off import read_progress_log
from bus.fenced_stream import LOG_READERS_GROUP
from bus.reconnect import ensure_group
from bus.replies import ReplyReader
from gpu_worker import Engine
from gpu_worker.worker import Worker
from jobs.progress import rebuild
from jobs.protocol import (
    ENTRY_FIELD,
    TOKENS_FIELD,
    ErrorReply,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TokenItem,
    TokenizedRequest,
    decode,
    encode,
)
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage
from tests.worker_thread import published_entries, wait_until

MODEL = "random:tiny-llama"
PROMPT = [5, 17, 99, 3, 250, 41, 7, 12]
SLOW = {  # ~20 ms a step, so an interval covers several
    "name": "slow",
    "target_modules": "lm_head",
    "hook_factory": "tests.hook_factories.slow_down",
    "config": {"seconds": 0.02},
}
GREEDY = {"ignore_eos": True, "temperature": 0.0}


def _item(rid: str, reply_to: str, start: int, ids: list[int], bundle: bool) -> TokenItem:
    return TokenItem(rid, reply_to, start, ids, [], 0, bundle=bundle)


def test_the_detokenizer_writes_one_entry_per_reply_stream_per_batch_for_bundling_jobs():
    stage = DetokenizerStage(BusConfig(), None)
    batch = [
        Inbound(b"1-0", TokenBatch("w1", 1, [_item("a", "R1", 0, [1, 2], True),
                                             _item("c", "R2", 0, [3], True)])),
        Inbound(b"2-0", TokenBatch("w2", 1, [_item("b", "R1", 4, [5], True),
                                             _item("d", "R1", 0, [6], False)])),
    ]  # fmt: skip
    outputs = stage.handle(batch)
    writes = [(o.stream, o.message) for o in outputs if isinstance(o, Outbound)]
    assert [(stream, type(m)) for stream, m in writes] == [
        ("R1", TextDeltas), ("R2", TextDeltas), ("R1", TextDelta)
    ]  # fmt: skip
    assert [(d.rid, d.seq, d.ids) for d in writes[0][1].deltas] == [("a", 0, [1, 2]), ("b", 4, [5])]
    assert writes[2][1].rid == "d"  # a job that did not ask reads one delta per entry
    expiries = [o.key for o in outputs if isinstance(o, ExpireKey)]
    assert expiries == ["R1", "R2"]  # once per stream per batch


def test_a_reply_reader_takes_bundles_apart_in_order(redis_client):
    stream = "t:bundled"
    reader = ReplyReader(redis_client, stream, block_ms=50)
    for rid in ("a", "b"):
        reader.register(rid)
    entries = [
        TextDeltas([TextDelta("a", 1, [2]), TextDelta("b", 0, [7])]),  # a's 1 before its 0
        TextDeltas([TextDelta("a", 0, [1]), TextDelta("b", 1, [], finish=None)]),
        TextDelta("a", 2, [3]),
    ]
    for message in entries:
        redis_client.xadd(stream, {ENTRY_FIELD: encode(message)})
    got = [reader.get("a", timeout=5).ids for _ in range(3)]
    assert got == [[1], [2], [3]]
    assert reader.get("b", timeout=5).ids == [7]


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, heartbeat_interval_s=0.2,
                     publish_interval_ms=150, trim_interval_s=0.05)  # fmt: skip


def _start(
    client: redis.Redis, config: BusConfig, worker_id: str
) -> tuple[Worker, threading.Thread]:
    worker = Worker(Engine(MODEL, dtype="float32", forward_hooks=[SLOW]), client, config,
                    worker_id, MODEL)  # fmt: skip
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def _batches(client: redis.Redis, config: BusConfig) -> list[TokenBatch]:
    return [decode(f[ENTRY_FIELD], TokenBatch) for _, f in published_entries(client, config)]


def _output(batches: list[TokenBatch], rid: str) -> list[int]:
    ids: list[int] = []
    for batch in batches:
        for item in batch.items:
            if item.rid == rid:
                assert item.start == len(ids)  # no gap, no repeat
                ids += item.ids
    return ids


def test_a_busy_worker_publishes_per_interval_and_logs_progress_without_a_command_per_token(
    redis_client, config
):
    jobs = [TokenizedRequest(f"r{i}", "t:reply", PROMPT[i:], {**GREEDY, "max_new_tokens": 40},
                             bundle_replies=True) for i in range(3)]  # fmt: skip
    worker, thread = _start(redis_client, config, "w")
    try:
        wait_until(lambda: redis_client.exists(config.heartbeat_key("w")))
        redis_client.config_resetstat()
        for job in jobs:
            redis_client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})
        wait_until(lambda: sum(1 for b in _batches(redis_client, config)
                               for i in b.items if i.finish) == 3)  # fmt: skip
        stats = {k.removeprefix("cmdstat_"): v["calls"]
                 for k, v in redis_client.info("commandstats").items()}  # fmt: skip
    finally:
        worker.stop.set()
        thread.join(timeout=30)
    batches = _batches(redis_client, config)
    for job in jobs:
        assert len(_output(batches, job.rid)) == 40
        assert all(i.bundle for b in batches for i in b.items)
    steps = worker.steps
    assert len(batches) < steps / 3, (len(batches), steps)  # ~7 steps per 150 ms publish
    assert "append" not in stats  # no progress key per job any more
    # Per commit its log entry (the fence: bus/fenced_stream.py; empty when no job has new
    # ids), which holds the TokenBatch when it publishes (the reply streams are not written
    # here); an entry of the blocks the prefix cache stored when it stored some (at most one
    # a publish, and the empty snapshot of the worker's start); and this test's 3 jobs. A
    # commit without tokens (acks, say) is rare: a few, not one per step. A commit is a
    # script, or its log entry's XADD alone when it writes nothing else.
    kv_entries = redis_client.xlen(config.kv_events_stream())
    assert kv_entries <= len(batches) + 1
    commits = stats["xadd"] - kv_entries - len(jobs)
    assert commits <= len(batches) + 3, (commits, len(batches))
    assert stats.get("evalsha", 0) <= commits
    assert stats.get("expire", 0) <= 3  # no key per job to renew (no route key: bus/aborts.py)


def test_a_worker_restarted_under_its_id_resumes_its_jobs_from_its_own_log(redis_client, config):
    # Long enough that no host finishes it between two looks (a finished job's log is trimmed).
    sampling = {**GREEDY, "max_new_tokens": 400}
    expected = Engine(MODEL, dtype="float32").generate(input_ids=PROMPT, sampling_params=sampling)
    job = TokenizedRequest("r1", "t:reply", PROMPT, sampling, bundle_replies=True)
    logged = lambda: rebuild(read_progress_log(redis_client, config, "w"), {"r1": []})["r1"]  # noqa: E731

    first, thread = _start(redis_client, config, "w")
    try:
        redis_client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})
        wait_until(lambda: len(logged()) >= 10)
    finally:
        first.stop.set()  # as SIGTERM: publishes what it generated, leaves the job pending
        thread.join(timeout=30)
    produced = len(logged())
    assert 10 <= produced < 400
    assert len(_output(_batches(redis_client, config), "r1")) == produced

    second, thread = _start(redis_client, config, "w")  # the same id: takes the job back
    reading, read = threading.Event(), []
    log = config.progress_stream("w")
    reader = threading.Thread(target=_read_as_detokenizers, args=(redis_client, log, reading, read),
                              daemon=True)  # fmt: skip
    reader.start()
    try:
        wait_until(lambda: any(i.finish for b in list(read) for i in b.items))
    finally:
        second.stop.set()
        thread.join(timeout=30)
        reading.set()
        reader.join(timeout=30)
    assert _output(read, "r1") == expected["output_ids"]  # both lives' batches, read in order
    # The job ended: the log keeps at most its last entries (trimmed at each interval, never
    # below what the detokenizers have not read).
    assert redis_client.xlen(log) <= 3


def _read_as_detokenizers(client: redis.Redis, log: str, done: threading.Event,
                          read: list[TokenBatch]) -> None:  # fmt: skip
    """Read and acknowledge a worker's log in the detokenizers' group, as they do, keeping
    the token batches in `read`."""
    while not done.is_set():
        found = client.xreadgroup(LOG_READERS_GROUP, "reader", {log: ">"}, block=5)
        for _, entries in found or []:
            read += [decode(f[TOKENS_FIELD], TokenBatch) for _, f in entries if TOKENS_FIELD in f]
            client.xack(log, LOG_READERS_GROUP, *[entry_id for entry_id, _ in entries])


def test_the_detokenizer_bundles_a_busy_workers_replies_end_to_end(redis_client, config):
    """Jobs through a worker and a detokenizer stage replica to one reply stream: every
    delta reaches the reader, in far fewer entries than deltas."""
    jobs = [TokenizedRequest(f"e{i}", "t:replies", PROMPT[i:], {**GREEDY, "max_new_tokens": 30},
                             bundle_replies=True) for i in range(4)]  # fmt: skip
    stage = DetokenizerStage(config, None)
    ensure_group(redis_client, stage.input_stream(config), stage.group)
    actor = Actor(redis_client, config, stage)
    reader = ReplyReader(redis_client, "t:replies", block_ms=50)
    for job in jobs:
        reader.register(job.rid)
    worker, thread = _start(redis_client, config, "w")
    try:
        for job in jobs:
            redis_client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})
        outputs: dict[str, list[int]] = {job.rid: [] for job in jobs}
        deltas = 0
        for job in jobs:
            while True:
                actor.run_once()
                try:
                    delta = reader.get(job.rid, timeout=0.05)
                except TimeoutError:
                    continue
                deltas += 1
                outputs[job.rid] += delta.ids
                if delta.finish is not None:
                    break
    finally:
        worker.stop.set()
        thread.join(timeout=30)
    assert all(len(ids) == 30 for ids in outputs.values())
    assert redis_client.xlen("t:replies") < deltas


def test_a_job_carrying_progress_continues_after_it_and_one_carrying_too_much_is_refused(
    redis_client, config
):
    sampling = {**GREEDY, "max_new_tokens": 12}
    expected = Engine(MODEL, dtype="float32").generate(input_ids=PROMPT, sampling_params=sampling)
    done = expected["output_ids"][:5]
    jobs = [
        TokenizedRequest("moved", "t:replies", PROMPT, sampling, progress=done),
        TokenizedRequest("forged", "t:replies", PROMPT, sampling, progress=[1] * 13),
    ]
    worker, thread = _start(redis_client, config, "w")
    try:
        for job in jobs:
            redis_client.xadd(config.worker_stream("w"), {ENTRY_FIELD: encode(job)})
        wait_until(lambda: any(i.finish for b in _batches(redis_client, config) for i in b.items)
              and redis_client.xlen("t:replies") > 0)  # fmt: skip
    finally:
        worker.stop.set()
        thread.join(timeout=30)
    items = [i for b in _batches(redis_client, config) for i in b.items if i.rid == "moved"]
    assert items[0].start == 5  # after what it carried
    assert sum((i.ids for i in items), done) == expected["output_ids"]
    (refusal,) = [decode(f[ENTRY_FIELD], ErrorReply) for _, f in redis_client.xrange("t:replies")]
    assert (refusal.rid, refusal.status, refusal.param) == ("forged", 400, "output_ids")
