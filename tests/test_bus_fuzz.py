"""Hostile input on the bus: whatever bytes or msgpack anyone puts on a stream, decoding says
ProtocolError (never another exception), each CPU stage dead-letters what it cannot handle
and keeps serving, and the worker turns a bad job into an error reply, not a crash.

Property-based (hypothesis): random bytes, random msgpack values, and maps with a real
message kind and fields of random types, which get furthest into the code.
"""

from __future__ import annotations

import threading

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jobs.protocol as wire
from bus.actor import Actor
from bus.reconnect import ensure_group
from jobs.job_failures import malformed_reply, reply_address
from jobs.model_tokenizer import load_model_tokenizer
from jobs.protocol import (
    ENTRY_FIELD,
    MESSAGE_TYPES,
    ErrorReply,
    GenerateRequest,
    ProtocolError,
    TextDelta,
    TokenizedRequest,
    decode,
    encode,
    job_payloads,
)
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage
from stages.router.stage import RouterStage
from stages.tokenizer.stage import TokenizerStage
from tests.ingress_harness import add_worker

FIELD_NAMES = sorted({name for cls in MESSAGE_TYPES.values() for name in cls.FIELDS})
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# A real kind with its own field names (and some others) set to anything.
shaped_maps = st.builds(
    lambda kind, fields: {"kind": kind, **fields},
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), values, max_size=8),
)
payloads = st.binary(max_size=64) | values.map(msgpack.packb) | shaped_maps.map(msgpack.packb)

FAST = settings(max_examples=300, deadline=None, database=None)


@FAST
@given(payload=payloads)
def test_decoding_anything_gives_a_message_or_a_protocol_error(payload):
    try:
        message = decode(payload, *MESSAGE_TYPES.values())
    except ProtocolError:
        return
    assert decode(encode(message), type(message)) == message  # what decodes, round-trips


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_tokenizer("smollm2-135m-instruct")


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=5, no_worker_timeout_s=0.5)


def _stages(config: BusConfig, client: redis.Redis, tokenizer):
    return [
        TokenizerStage(config, tokenizer),
        RouterStage(config, client, threading.Event()),
        DetokenizerStage(config, tokenizer),
    ]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["tokenizer", "router", "detokenizer"])
def test_a_stage_fed_anything_dead_letters_it_and_keeps_serving(
    redis_client, config, tokenizer, index
):
    stage = _stages(config, redis_client, tokenizer)[index]
    stream = stage.input_stream(config)
    ensure_group(redis_client, stream, stage.group)
    actor = Actor(redis_client, config, stage)
    add_worker(redis_client, config)

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(batch=st.lists(payloads, min_size=1, max_size=4))
    def check(batch):
        for payload in batch:
            redis_client.xadd(stream, {ENTRY_FIELD: payload})
        while actor.run_once():
            pass
        assert redis_client.xpending(stream, stage.group)["pending"] == 0

    check()
    assert actor.dead_lettered > 0  # the garbage did arrive
    # Still serving: a valid job goes through the tokenizer like any other.
    if index == 0:
        job = GenerateRequest("ok", "t:reply", prompt="Hello")
        redis_client.xadd(stream, {ENTRY_FIELD: encode(job)})
        actor.run_once()
        tokenized = redis_client.xrange(config.tokenized_stream())
        assert any(b"ok" in payload for _, fields in tokenized for payload in job_payloads(fields))
    dead = redis_client.xrange(config.dead_letter_stream())
    assert all(fields.get(b"reason") for _, fields in dead)


@pytest.fixture(scope="module")
def engine():
    from gpu_worker import Engine

    return Engine("random:tiny-llama", dtype="float32")


def test_a_worker_given_bad_jobs_answers_each_with_an_error_or_tokens(redis_url, engine):
    """Sampling parameters and token ids of every shape reach the worker's own checks: each
    job ends in an error reply, a dead letter, or a finished generation, and the loop lives."""
    from gpu_worker.worker import Worker

    client = redis.Redis.from_url(redis_url)
    client.flushall()
    config = BusConfig(redis_url=redis_url, block_ms=5)
    worker = Worker(engine, client, config, "fuzz", "random:tiny-llama")
    ensure_group(client, worker.bus.stream, "worker")
    sampling = st.dictionaries(
        st.sampled_from(["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                         "stop", "stop_token_ids", "logit_bias", "logprobs", "top_logprobs",
                         "min_new_tokens", "ignore_eos", "repetition_penalty", "unknown"]),
        values,
        max_size=5,
    )  # fmt: skip
    jobs = st.builds(
        lambda ids, params: msgpack.packb(
            {
                "kind": "tokenized",
                "rid": "r",
                "reply_to": "t:fuzz",
                "input_ids": ids,
                "sampling": params,
            }
        ),  # fmt: skip
        st.binary(max_size=24),
        sampling,
    )
    seen = {"n": 0}

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(payload=jobs | payloads)
    def check(payload):
        seen["n"] += 1
        rid = f"r{seen['n']}"
        try:
            data = msgpack.unpackb(payload)
            if isinstance(data, dict) and data.get("kind") == "tokenized":
                data["rid"] = rid
                payload = msgpack.packb(data)
        except Exception:
            pass
        client.xadd(worker.bus.stream, {ENTRY_FIELD: payload})
        entries = worker.bus.read_blocking()
        worker._admit(entries)
        for _ in range(8):
            if worker.scheduler.has_work():
                worker._step()
        for rid in list(worker.jobs):  # a valid job may want thousands of tokens: stop it
            worker._abort(rid)
        worker._commit(read=False)
        assert not worker.jobs
        assert client.xpending(worker.bus.stream, "worker")["pending"] == 0

    check()
    assert client.xlen("t:fuzz") > 0  # some jobs got as far as the worker's own checks
    for _, fields in client.xrange("t:fuzz"):
        decode(fields[ENTRY_FIELD], ErrorReply, TextDelta)  # whatever it said is well-formed


# A generate job naming its requester, every other field drawn from anything.
answerable_jobs = st.builds(
    lambda fields, rid: {**fields, "kind": "generate", "rid": rid, "reply_to": "t:fuzz-replies"},
    st.dictionaries(st.sampled_from(sorted(GenerateRequest.FIELDS)) | st.text(max_size=6),
                    values, max_size=6),
    st.uuids().map(str),
)  # fmt: skip


def test_every_job_that_names_its_requester_is_forwarded_or_answered(
    redis_client, config, tokenizer
):
    """Nothing is lost: whatever else a job holds, one that says who waits for it goes on to
    the next stage or its requester gets an error reply, never only a dead letter."""
    stage = TokenizerStage(config, tokenizer)
    stream = stage.input_stream(config)
    ensure_group(redis_client, stream, stage.group)
    actor = Actor(redis_client, config, stage)

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(job=answerable_jobs)
    def check(job):
        redis_client.xadd(stream, {ENTRY_FIELD: msgpack.packb(job, use_bin_type=True)})
        while actor.run_once():
            pass
        forwarded = {
            decode(payload, TokenizedRequest).rid
            for _, fields in redis_client.xrange(config.tokenized_stream())
            for payload in job_payloads(fields)
        }
        answered = {
            decode(fields[ENTRY_FIELD], ErrorReply).rid
            for _, fields in redis_client.xrange("t:fuzz-replies")
        }
        assert job["rid"] in forwarded | answered

    check()


@FAST
@given(payload=payloads | answerable_jobs.map(msgpack.packb))
def test_reading_the_requester_of_any_entry_never_raises(payload):
    address = reply_address(payload)
    if address is not None:
        rid, reply_to = address
        assert isinstance(rid, str) and isinstance(reply_to, str)
        try:
            decode(payload, *MESSAGE_TYPES.values())
        except ProtocolError as exc:
            (_, answer) = malformed_reply(payload, exc)
            assert decode(encode(answer), ErrorReply) == answer  # a well-formed reply


# Token items of the right types holding anything: ids no tokenizer decodes (negative, past
# the vocabulary), logprobs and top logprobs of any shape, any start, stop strings, finish.
token_ids = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=5)
token_items = st.builds(
    wire.TokenItem,
    rid=st.sampled_from(["a", "b", None]),
    reply_to=st.sampled_from(["t:items-1", "t:items-2"]),
    start=st.integers(min_value=0, max_value=2**40),
    ids=token_ids,
    context=token_ids,
    prompt_context=st.integers(min_value=0, max_value=6),
    stop=st.lists(st.text(max_size=3), max_size=2),
    skip_special_tokens=st.booleans(),
    finish=st.none() | st.builds(wire.Finish, st.sampled_from(["stop", "length", "abort"]),
                                 st.none(), st.integers(0, 99), st.integers(0, 99)),
    logprobs=st.none() | st.lists(st.floats(allow_nan=False), max_size=3),
    top_logprobs=st.none() | st.lists(st.lists(st.lists(st.integers(-5, 60_000), max_size=3),
                                               max_size=2), max_size=3),
    prompt_ids=st.none() | token_ids,
    bundle=st.booleans(),
    tag=st.none() | st.integers(min_value=0, max_value=2**31),
).filter(lambda item: _reads(item))  # fmt: skip


def _reads(item: wire.TokenItem) -> bool:
    """Whether `item` reads back (the wire refuses e.g. a rid-less item with no tag; such an
    item's own test is tests/test_detokenizer_bad_items.py)."""
    try:
        wire.TokenItem.from_wire(item.to_wire())
    except ProtocolError:
        return False
    return True


def test_the_detokenizer_sends_every_well_typed_item_on_whatever_values_it_holds(
    redis_client, config, tokenizer
):
    """A batch holds many requests' tokens: each item's delta is sent, so no request waits
    for tokens that never come, whatever another item of its batch holds (ids no tokenizer
    decodes, logprobs of any shape)."""
    stage = DetokenizerStage(config, tokenizer)
    stream = stage.input_stream(config)
    ensure_group(redis_client, stream, stage.group)
    actor = Actor(redis_client, config, stage)
    for name in ("t:items-1", "t:items-2"):  # as a reader makes its stream
        redis_client.xadd(name, {"made": b""})

    @settings(max_examples=80, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(items=st.lists(token_items, min_size=1, max_size=4))
    def check(items):
        # The reply streams are kept (a bundled one is written only where it exists, as
        # its reader's is): this batch's replies are those after the last ones.
        seen = {name: (redis_client.xrevrange(name, count=1) or [(b"0-0", None)])[0][0]
                for name in ("t:items-1", "t:items-2")}  # fmt: skip
        batch = wire.TokenBatch("w1", 1, items)
        redis_client.xadd(stream, {ENTRY_FIELD: encode(batch)})
        while actor.run_once():
            pass
        sent = 0
        for name, last in seen.items():
            for _, fields in redis_client.xrange(name, min=b"(" + last):
                reply = decode(fields[ENTRY_FIELD], wire.TextDeltas, TextDelta)
                sent += len(reply.deltas) if isinstance(reply, wire.TextDeltas) else 1
        assert sent == len(items)

    check()
    assert actor.dead_lettered == 0
