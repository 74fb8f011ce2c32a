"""The router and tokenizer stages driven by the real actor runtime on a real server.

Workers are only keys here: a heartbeat (``encode(Heartbeat)`` with a TTL) and a member of
the workers set, which is all the router reads.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from bus.actor import Actor
from bus.reconnect import ensure_group
from jobs.protocol import (
    ENTRY_FIELD,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    TokenizedRequest,
    decode,
    encode,
    job_payloads,
)
from runtime.config import BusConfig
from stages.router.stage import RouterStage, live_workers
from stages.tokenizer.stage import TokenizerStage

REPLY = "t:reply"


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, no_worker_timeout_s=0.5)


def _beat(
    client: redis.Redis,
    config: BusConfig,
    worker_id: str,
    running: int = 0,
    waiting: int = 0,
    free_kv: int = 10_000,
    admitted: int = 0,
    ttl_ms: int = 5_000,
) -> None:
    beat = Heartbeat(
        worker_id, config.worker_stream(worker_id), "random:tiny", running, waiting, free_kv,
        20_000, admitted, time.time(),
    )  # fmt: skip
    client.set(config.heartbeat_key(worker_id), encode(beat), px=ttl_ms)
    client.sadd(config.workers_key(), worker_id)


def _router(client: redis.Redis, config: BusConfig, stop: threading.Event | None = None) -> Actor:
    stop = stop if stop is not None else threading.Event()
    stage = RouterStage(config, client, stop)
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage, stop)


def _job(client: redis.Redis, config: BusConfig, rid: str, reply_to: str = REPLY) -> None:
    job = TokenizedRequest(rid, reply_to, [1, 2, 3], {"max_new_tokens": 4}, 1.5)
    client.xadd(config.tokenized_stream(), {ENTRY_FIELD: encode(job)})


def _routed(client: redis.Redis, config: BusConfig, worker_id: str) -> list[str]:
    """The rids on a worker's stream, in order."""
    return [
        decode(fields[ENTRY_FIELD], TokenizedRequest).rid
        for _, fields in client.xrange(config.worker_stream(worker_id))
    ]


def _errors(client: redis.Redis, stream: str = REPLY) -> list[ErrorReply]:
    return [decode(fields[ENTRY_FIELD], ErrorReply) for _, fields in client.xrange(stream)]


def _dead_letter_count(client: redis.Redis, config: BusConfig) -> int:
    return client.xlen(config.dead_letter_stream())


# ---- router ----------------------------------------------------------------------------------


def test_a_job_goes_to_the_worker_with_the_least_running_waiting_and_in_transit(
    redis_client, config
):
    _beat(redis_client, config, "busy", running=3, waiting=1)  # queued 4
    _beat(redis_client, config, "light", running=1, waiting=1)  # queued 2
    # Idle by its own account, but 5 routed to it of which it has read 2: 3 in transit.
    _beat(redis_client, config, "swamped", admitted=2)
    redis_client.hset(config.routed_key(), "swamped", 5)

    _job(redis_client, config, "r1")
    _router(redis_client, config).run_once()
    assert _routed(redis_client, config, "light") == ["r1"]
    assert _routed(redis_client, config, "busy") == []
    assert _routed(redis_client, config, "swamped") == []


def test_the_forwarded_job_is_the_job_as_received_with_why_it_went_there(redis_client, config):
    _beat(redis_client, config, "w1")
    _job(redis_client, config, "r1", reply_to="t:reply-7")
    _router(redis_client, config).run_once()
    ((_, fields),) = redis_client.xrange(config.worker_stream("w1"))
    expected = TokenizedRequest("r1", "t:reply-7", [1, 2, 3], {"max_new_tokens": 4}, 1.5,
                                route_reason="load", expected_cached=0)  # fmt: skip
    assert decode(fields[ENTRY_FIELD], TokenizedRequest) == expected


def test_live_workers_reports_each_workers_queue_including_jobs_in_transit(redis_client, config):
    _beat(redis_client, config, "w1", running=2, waiting=3, free_kv=111, admitted=10)
    _beat(redis_client, config, "w2", admitted=4)
    redis_client.hset(config.routed_key(), mapping={"w1": 12, "w2": 3})
    loads = {w.worker_id: w for w in live_workers(redis_client, config)}
    assert (loads["w1"].queued, loads["w1"].free_kv_tokens) == (2 + 3 + 2, 111)
    assert loads["w1"].stream == config.worker_stream("w1")
    # A worker that has read more than the hash says (e.g. it was reset) owes nothing.
    assert loads["w2"].queued == 0


def test_a_burst_is_spread_evenly_across_equal_workers(redis_client, config):
    workers = ["w1", "w2", "w3"]
    for worker_id in workers:
        _beat(redis_client, config, worker_id)
    rids = [f"r{i}" for i in range(9)]
    for rid in rids:
        _job(redis_client, config, rid)
    assert _router(redis_client, config).run_once() == 9
    per_worker = {w: _routed(redis_client, config, w) for w in workers}
    assert [len(per_worker[w]) for w in workers] == [3, 3, 3]
    assert sorted(rid for routed in per_worker.values() for rid in routed) == rids


def test_of_equally_queued_workers_the_one_with_more_free_kv_is_chosen(redis_client, config):
    _beat(redis_client, config, "small", free_kv=100)
    _beat(redis_client, config, "large", free_kv=9_000)
    _job(redis_client, config, "r1")
    _router(redis_client, config).run_once()
    assert _routed(redis_client, config, "large") == ["r1"]


def test_each_batch_counts_its_jobs_in_the_routed_hash_and_writes_no_key_per_job(
    redis_client, config
):
    for worker_id in ("w1", "w2"):
        _beat(redis_client, config, worker_id)
    for i in range(4):
        _job(redis_client, config, f"r{i}")
    keys_before = set(redis_client.keys("*"))
    _router(redis_client, config).run_once()
    assert sorted(_routed(redis_client, config, "w1") + _routed(redis_client, config, "w2")) == [
        "r0", "r1", "r2", "r3"
    ]  # fmt: skip
    assert redis_client.hgetall(config.routed_key()) == {b"w1": b"2", b"w2": b"2"}
    # No route key per job (an abort is a flag the worker reads: bus/aborts.py).
    new_keys = set(redis_client.keys("*")) - keys_before
    assert new_keys <= {config.routed_key().encode()} | {
        config.worker_stream(w).encode() for w in ("w1", "w2")
    }  # fmt: skip
    assert redis_client.xpending(config.tokenized_stream(), "router")["pending"] == 0


def test_router_replicas_see_each_others_routing_through_the_routed_hash(redis_client, config):
    for worker_id in ("w1", "w2"):
        _beat(redis_client, config, worker_id)
    first, second = _router(redis_client, config), _router(redis_client, config)
    _job(redis_client, config, "r1")
    first.run_once()
    _job(redis_client, config, "r2")
    second.run_once()  # a fresh replica: only Redis tells it that w1 already has r1
    assert sorted([_routed(redis_client, config, "w1"), _routed(redis_client, config, "w2")]) == [
        ["r1"],
        ["r2"],
    ]


def test_a_worker_whose_heartbeat_expired_gets_nothing(redis_client, config):
    _beat(redis_client, config, "gone", ttl_ms=30)  # idle, but about to fall silent
    _beat(redis_client, config, "alive", running=5)
    deadline = time.monotonic() + 2
    while redis_client.exists(config.heartbeat_key("gone")) and time.monotonic() < deadline:
        time.sleep(0.01)
    _job(redis_client, config, "r1")
    _router(redis_client, config).run_once()
    assert _routed(redis_client, config, "alive") == ["r1"]
    assert _routed(redis_client, config, "gone") == []


def test_a_worker_with_a_malformed_heartbeat_is_skipped(redis_client, config):
    redis_client.set(config.heartbeat_key("garbled"), b"\xc1", px=5_000)
    redis_client.sadd(config.workers_key(), "garbled")
    _beat(redis_client, config, "sound", running=9)
    _job(redis_client, config, "r1")
    _router(redis_client, config).run_once()
    assert _routed(redis_client, config, "sound") == ["r1"]
    assert _routed(redis_client, config, "garbled") == []


def test_with_no_live_worker_jobs_wait_then_each_gets_a_503(redis_client, config):
    _job(redis_client, config, "r1")
    _job(redis_client, config, "r2", reply_to="t:reply-2")
    router = _router(redis_client, config)
    started = time.monotonic()
    assert router.run_once() == 2
    waited = time.monotonic() - started
    assert config.no_worker_timeout_s <= waited < config.no_worker_timeout_s + 0.5
    for rid, stream in (("r1", REPLY), ("r2", "t:reply-2")):
        (error,) = _errors(redis_client, stream)
        assert (error.rid, error.status) == (rid, 503)
        assert (error.type, error.code) == ("service_unavailable", "no_worker")
        assert "no live worker" in error.message
    assert redis_client.xpending(config.tokenized_stream(), "router")["pending"] == 0


def test_a_worker_that_appears_during_the_wait_gets_the_jobs(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, block_ms=20, no_worker_timeout_s=3.0)
    _job(redis_client, config, "r1")
    _job(redis_client, config, "r2")
    arrival = threading.Timer(0.15, _beat, args=(redis_client, config, "late"))
    arrival.start()
    started = time.monotonic()
    try:
        _router(redis_client, config).run_once()
    finally:
        arrival.cancel()
    assert time.monotonic() - started < 1.0
    assert _routed(redis_client, config, "late") == ["r1", "r2"]
    assert _errors(redis_client) == []


def test_a_job_held_while_no_worker_is_live_is_routed_once_across_replicas(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, block_ms=20, claim_idle_ms=600, no_worker_timeout_s=4.0)
    stop = threading.Event()
    replicas = [_router(redis_client, config, stop), _router(redis_client, config, stop)]
    _job(redis_client, config, "r1")
    threads = [threading.Thread(target=replica.run_once, daemon=True) for replica in replicas]
    threads[0].start()
    time.sleep(1.0)  # the first replica holds the job longer than claim_idle_ms, touching it
    threads[1].start()
    time.sleep(0.5)
    _beat(redis_client, config, "w1")
    for thread in threads:
        thread.join(timeout=5)
    stop.set()
    assert _routed(redis_client, config, "w1") == ["r1"]


# ---- tokenizer without a tokenizer (a random: model) ---------------------------------------


def _tokenizer(client: redis.Redis, config: BusConfig) -> Actor:
    stage = TokenizerStage(config, tokenizer=None)
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage)


def _request(client: redis.Redis, config: BusConfig, job: GenerateRequest) -> None:
    client.xadd(config.requests_stream(), {ENTRY_FIELD: encode(job)})


def _tokenized(client: redis.Redis, config: BusConfig) -> list[TokenizedRequest]:
    return [
        decode(payload, TokenizedRequest)
        for _, fields in client.xrange(config.tokenized_stream())
        for payload in job_payloads(fields)
    ]


def test_tokenizer_passes_input_ids_through_with_sampling_and_created(redis_client, config):
    job = GenerateRequest(
        "r1", REPLY, input_ids=[5, 0, 70_000], sampling={"temperature": 0.0}, created=9.5
    )
    _request(redis_client, config, job)
    assert _tokenizer(redis_client, config).run_once() == 1
    assert _tokenized(redis_client, config) == [
        TokenizedRequest("r1", REPLY, [5, 0, 70_000], {"temperature": 0.0}, 9.5)
    ]
    assert _errors(redis_client) == []


@pytest.mark.parametrize(
    "form",
    [{"prompt": "Hello"}, {"messages": [{"role": "user", "content": "Hello"}]}],
    ids=["prompt", "messages"],
)
def test_tokenizer_without_a_tokenizer_answers_text_jobs_with_400(redis_client, config, form):
    _request(redis_client, config, GenerateRequest("r1", REPLY, **form))
    _request(redis_client, config, GenerateRequest("r2", REPLY, input_ids=[1]))
    _tokenizer(redis_client, config).run_once()
    (error,) = _errors(redis_client)
    assert (error.rid, error.status, error.type) == ("r1", 400, "invalid_request_error")
    assert "send input_ids" in error.message
    assert [job.rid for job in _tokenized(redis_client, config)] == ["r2"]
    assert redis_client.xpending(config.requests_stream(), "tokenizer")["pending"] == 0


def test_tokenizer_400_for_a_text_job_names_no_bogus_param(redis_client, config):
    _request(redis_client, config, GenerateRequest("r1", REPLY, prompt="Hello"))
    _tokenizer(redis_client, config).run_once()
    (error,) = _errors(redis_client)
    assert error.param in (None, "prompt")


@pytest.mark.parametrize(
    ("ids", "reason"),
    [([], "input_ids: the prompt is empty"), ([3, -1], "input_ids: token ids must be >= 0")],
    ids=["empty", "negative"],
)
def test_tokenizer_answers_bad_input_ids_with_400_naming_the_field(
    redis_client, config, ids, reason
):
    _request(redis_client, config, GenerateRequest("r1", REPLY, input_ids=ids))
    _tokenizer(redis_client, config).run_once()
    (error,) = _errors(redis_client)
    assert (error.rid, error.status, error.param, error.message) == ("r1", 400, "input_ids", reason)
    assert _tokenized(redis_client, config) == []


# ---- tokenizer with the default model's tokenizer --------------------------------------------


@pytest.fixture(scope="module")
def stage_tokenizer():
    from jobs.model_tokenizer import load_model_tokenizer

    return load_model_tokenizer("smollm2-135m-instruct")


def test_tokenizer_encodes_prompts_and_chats_of_a_mixed_batch_each_to_its_own_ids(
    redis_client, config, stage_tokenizer
):
    chat = [{"role": "user", "content": "What is 2+2?"}]
    jobs = [
        GenerateRequest("p1", REPLY, prompt="The capital of France is"),
        GenerateRequest("ids", REPLY, input_ids=[7, 8]),
        GenerateRequest("chat", REPLY, messages=chat),
        GenerateRequest("p2", REPLY, prompt="Hello"),
    ]
    for job in jobs:
        _request(redis_client, config, job)
    stage = TokenizerStage(config, stage_tokenizer)
    ensure_group(redis_client, stage.input_stream(config), stage.group)
    assert Actor(redis_client, config, stage).run_once() == 4

    tokenized = {job.rid: job.input_ids for job in _tokenized(redis_client, config)}
    assert tokenized == {
        "p1": stage_tokenizer.encode("The capital of France is"),
        "ids": [7, 8],
        "chat": stage_tokenizer.apply_chat_template(chat),
        "p2": stage_tokenizer.encode("Hello"),
    }
    assert tokenized["p1"] != tokenized["p2"]
    assert stage_tokenizer.decode(tokenized["chat"], skip_special_tokens=False).endswith(
        "assistant\n"
    )


@pytest.mark.parametrize(
    ("job", "param"),
    [
        (GenerateRequest("bad", REPLY, prompt=""), "prompt"),
        (GenerateRequest("bad", REPLY, messages=[{"role": "user"}]), "messages[0]"),
        (GenerateRequest("bad", REPLY, messages=[]), "messages"),
    ],
    ids=["empty-prompt", "message-without-content", "no-messages"],
)
def test_tokenizer_answers_an_untokenizable_job_with_400_and_serves_the_rest(
    redis_client, config, stage_tokenizer, job, param
):
    _request(redis_client, config, job)
    _request(redis_client, config, GenerateRequest("good", REPLY, prompt="Hi"))
    stage = TokenizerStage(config, stage_tokenizer)
    ensure_group(redis_client, stage.input_stream(config), stage.group)
    Actor(redis_client, config, stage).run_once()
    (error,) = _errors(redis_client)
    assert (error.rid, error.status, error.param) == ("bad", 400, param)
    assert [job.rid for job in _tokenized(redis_client, config)] == ["good"]
    assert _dead_letter_count(redis_client, config) == 0


_ERROR_REPLY_TTL_BUG = (
    "{where} writes its ErrorReply with Outbound(reply_to, ...) and no expire_s, unlike the "
    "detokenizer's deltas (expire_s=reply_ttl_s): a reply stream that only ever gets an error "
    "(its client gone) never expires"
)


def test_a_reply_stream_holding_a_tokenizer_400_expires_after_reply_ttl(redis_client, config):
    _request(redis_client, config, GenerateRequest("r1", "t:lonely-reply", input_ids=[]))
    _tokenizer(redis_client, config).run_once()
    assert len(_errors(redis_client, "t:lonely-reply")) == 1
    assert 0 < redis_client.ttl("t:lonely-reply") <= config.reply_ttl_s


def test_a_reply_stream_holding_a_router_503_expires_after_reply_ttl(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, block_ms=20, no_worker_timeout_s=0.05)
    _job(redis_client, config, "r1", reply_to="t:lonely-reply")
    _router(redis_client, config).run_once()
    assert len(_errors(redis_client, "t:lonely-reply")) == 1
    assert 0 < redis_client.ttl("t:lonely-reply") <= config.reply_ttl_s
