"""Bundle entries on the job streams (jobs/wire.py): one entry carries a commit's jobs, each
read, handled or dead-lettered on its own and the entry acknowledged once; a malformed
bundle is dead-lettered whole; a bundle claimed after a delivery is split into single-job
entries, so each job counts its own deliveries."""

from __future__ import annotations

import asyncio
import time
import zlib

import msgpack
import pytest
import redis
import redis.asyncio as aredis

from bus.actor import Actor, Inbound
from bus.effects import Outbound, Output, reply, write_outputs
from bus.reconnect import ensure_group
from jobs import wire
from jobs.protocol import (
    ENTRY_FIELD,
    ErrorReply,
    GenerateRequest,
    TextDelta,
    TokenizedRequest,
    decode,
    encode,
)
from jobs.request_normaliser import ModelLimits
from jobs.wire import JOBS_FIELD, ProtocolError, job_entries, job_payloads
from runtime.config import BusConfig
from stages.ingress.request_writes import RequestWrites
from stages.tokenizer.stage import TokenizerStage

REPLY = "t:reply"


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20, claim_idle_ms=100, max_deliveries=2)


def _jobs(client: redis.Redis, stream: str) -> list[bytes | None]:
    """Every job payload on `stream`, bundles taken apart."""
    return [payload for _, fields in client.xrange(stream) for payload in job_payloads(fields)]


def _dead_letters(client: redis.Redis, config: BusConfig) -> list[dict[str, bytes]]:
    return [
        {key.decode(): value for key, value in fields.items()}
        for _, fields in client.xrange(config.dead_letter_stream())
    ]


def _replies(client: redis.Redis) -> list[ErrorReply | TextDelta]:
    return [decode(f[ENTRY_FIELD], ErrorReply, TextDelta) for _, f in client.xrange(REPLY)]


# ---- the codec ---------------------------------------------------------------------------------


def test_one_job_is_a_plain_entry_and_several_one_bundle_that_reads_back_in_order():
    assert job_entries([b"a"]) == [{ENTRY_FIELD: b"a"}]
    (bundle,) = job_entries([b"a", b"b", b"c"])
    assert list(bundle) == [JOBS_FIELD]
    assert job_payloads(bundle) == [b"a", b"b", b"c"]
    assert job_payloads({ENTRY_FIELD: b"a"}) == [b"a"]
    assert job_payloads({}) == [None]  # decode says what is missing


def test_bundles_are_cut_at_their_job_and_byte_bounds(monkeypatch):
    monkeypatch.setattr(wire, "MAX_BUNDLE_JOBS", 3)
    entries = job_entries([bytes([i]) for i in range(7)])
    assert [len(job_payloads(e)) for e in entries] == [3, 3, 1]
    assert ENTRY_FIELD in entries[-1]  # the one left over goes plain
    monkeypatch.setattr(wire, "MAX_BUNDLE_JOBS", 4096)
    monkeypatch.setattr(wire, "MAX_BUNDLE_BYTES", 10)
    entries = job_entries([b"x" * 6, b"y" * 6, b"z" * 20, b"a", b"b"])
    assert [job_payloads(e) for e in entries] == [[b"x" * 6], [b"y" * 6], [b"z" * 20],
                                                  [b"a", b"b"]]  # fmt: skip


MALFORMED_BUNDLES = {
    "not-msgpack": ({JOBS_FIELD: b"\xc1\xc1"}, "not msgpack"),
    "a-map": ({JOBS_FIELD: msgpack.packb({"kind": "generate"})}, "array"),
    "empty": ({JOBS_FIELD: msgpack.packb([])}, "empty array"),
    "ints-inside": ({JOBS_FIELD: msgpack.packb([b"ok", 7])}, "int"),
    "str-inside": ({JOBS_FIELD: msgpack.packb(["x"], use_bin_type=True)}, "str"),
    "too-many": ({JOBS_FIELD: msgpack.packb([b"x"] * (wire.MAX_BUNDLE_JOBS + 1))}, "4096"),
    "deflated": ({JOBS_FIELD: zlib.compress(msgpack.packb([b"x", b"y"]))}, "deflated"),
    "both-fields": ({ENTRY_FIELD: b"x", JOBS_FIELD: msgpack.packb([b"x", b"y"])}, "both"),
    "truncated": ({JOBS_FIELD: msgpack.packb([b"x" * 50, b"y"])[:-3]}, "not msgpack"),
}


@pytest.mark.parametrize("name", MALFORMED_BUNDLES)
def test_a_malformed_bundle_is_refused_with_its_reason(name):
    fields, reason = MALFORMED_BUNDLES[name]
    with pytest.raises(ProtocolError, match=reason):
        job_payloads(fields)


# ---- writing -----------------------------------------------------------------------------------


def test_a_commits_jobs_for_a_job_stream_go_in_one_entry_and_other_outputs_as_they_were(
    redis_client, config
):
    jobs = [TokenizedRequest(f"r{i}", REPLY, [i + 1]) for i in range(5)]
    pipe = redis_client.pipeline(transaction=True)
    write_outputs(pipe, config, [
        *(Outbound(config.tokenized_stream(), job) for job in jobs),
        Outbound(config.requests_stream(), GenerateRequest("g", REPLY, input_ids=[1])),
        reply(config, REPLY, ErrorReply("e", 400, "no")),
        reply(config, REPLY, ErrorReply("f", 400, "no")),
    ])  # fmt: skip
    pipe.execute()
    assert redis_client.xlen(config.tokenized_stream()) == 1
    assert [decode(p, TokenizedRequest) for p in _jobs(redis_client, config.tokenized_stream())] \
        == jobs  # fmt: skip
    # One job alone: a plain entry, as a user writing straight onto Redis writes it.
    ((_, fields),) = redis_client.xrange(config.requests_stream())
    assert list(fields) == [ENTRY_FIELD]
    assert redis_client.xlen(REPLY) == 2  # a reply stream's entries are never bundled


def _start_all(redis_url: str, config: BusConfig, starts: dict[str, list[GenerateRequest]],
               context_length: int | None = None) -> None:  # fmt: skip
    """The ingress's writes of `starts` (request id -> its jobs), all in one turn."""

    async def start() -> None:
        client = aredis.Redis.from_url(redis_url)
        await client.flushall()
        writes = RequestWrites(client, config, ModelLimits(context_length=context_length))
        await asyncio.gather(*(writes.start(request_id, b"1", jobs)
                               for request_id, jobs in starts.items()))  # fmt: skip
        await client.aclose()

    asyncio.run(start())


def test_the_ingress_writes_one_turns_jobs_as_one_entry_per_stream_with_each_requests_key(
    redis_url,
):
    """Prompts of token ids go straight to the router's stream, texts to the tokenizer's."""
    config = BusConfig(redis_url=redis_url)
    ids = {f"q{i}": [GenerateRequest(f"q{i}-{n}", REPLY, input_ids=[1]) for n in range(i + 1)]
           for i in range(3)}  # fmt: skip
    texts = {"t": [GenerateRequest(f"t-{n}", REPLY, prompt="hi") for n in range(2)]}
    embedding = GenerateRequest(
        "e-0",
        REPLY,
        input_ids=[1],
        sampling={"max_new_tokens": 0},
        pooling="mean",
        tenant="acme",
        weight=2.0,
        priority=3,
        tag=7,
    )
    _start_all(redis_url, config, {**ids, **texts, "e": [embedding]})
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(config.tokenized_stream()) == 1
    routed = [decode(p, TokenizedRequest) for p in _jobs(client, config.tokenized_stream())]
    assert [job.rid for job in routed] == ["q0-0", "q1-0", "q1-1", "q2-0", "q2-1", "q2-2", "e-0"]
    assert all(job.input_ids == [1] for job in routed)
    # Every field the tokenizer stage would have carried over.
    assert (
        routed[-1] == TokenizerStage(config, None).handle([Inbound(b"1-0", embedding)])[0].message
    )
    assert client.xlen(config.requests_stream()) == 1
    rids = [decode(p, GenerateRequest).rid for p in _jobs(client, config.requests_stream())]
    assert rids == ["t-0", "t-1"]
    assert all(client.get(config.request_key(r)) == b"1" for r in [*ids, *texts, "e"])


def test_the_ingress_refuses_an_id_prompt_past_the_context_as_the_tokenizer_stage_does(
    redis_url,
):
    config = BusConfig(redis_url=redis_url)
    long = GenerateRequest("long-0", REPLY, input_ids=[1] * 40, sampling={"max_new_tokens": 30})
    fits = GenerateRequest("fits-0", REPLY, input_ids=[1] * 40, sampling={"max_new_tokens": 24})
    _start_all(redis_url, config, {"long": [long], "fits": [fits]}, context_length=64)
    client = redis.Redis.from_url(redis_url)
    ((_, fields),) = client.xrange(REPLY)
    tokenizer = TokenizerStage(config, None, 64)
    (output,) = tokenizer.handle([Inbound(b"1-0", long)])
    assert fields[ENTRY_FIELD] == encode(output.message)  # the very reply that stage writes
    refusal = decode(fields[ENTRY_FIELD], ErrorReply)
    assert (refusal.rid, refusal.status, refusal.param, refusal.code) == (
        "long-0", 400, "max_new_tokens", "context_length_exceeded")  # fmt: skip
    assert client.ttl(REPLY) > 0  # as every reply the stages write
    routed = [decode(p, TokenizedRequest).rid for p in _jobs(client, config.tokenized_stream())]
    assert routed == ["fits-0"]
    assert client.xlen(config.requests_stream()) == 0


# ---- reading: the tokenizer stage --------------------------------------------------------------


def _tokenizer(client: redis.Redis, config: BusConfig) -> Actor:
    stage = TokenizerStage(config, tokenizer=None)
    ensure_group(client, stage.input_stream(config), stage.group)
    return Actor(client, config, stage)


def _bundle(client: redis.Redis, stream: str, payloads: list[bytes]) -> bytes:
    return client.xadd(stream, {JOBS_FIELD: msgpack.packb(payloads, use_bin_type=True)})


def test_a_bundle_of_jobs_through_the_tokenizer_is_one_entry_out_acked_once(redis_client, config):
    actor = _tokenizer(redis_client, config)
    jobs = [GenerateRequest(f"r{i}", REPLY, input_ids=[i + 1, 7]) for i in range(6)]
    _bundle(redis_client, config.requests_stream(), [encode(job) for job in jobs])
    assert actor.run_once() == 1
    assert actor.processed == 1
    assert redis_client.xlen(config.tokenized_stream()) == 1
    out = [decode(p, TokenizedRequest) for p in _jobs(redis_client, config.tokenized_stream())]
    assert [(job.rid, job.input_ids) for job in out] == [(f"r{i}", [i + 1, 7]) for i in range(6)]
    assert redis_client.xpending(config.requests_stream(), "tokenizer")["pending"] == 0
    assert _dead_letters(redis_client, config) == []


def test_a_bad_job_in_a_bundle_is_refused_alone_and_its_mates_are_handled(redis_client, config):
    actor = _tokenizer(redis_client, config)
    good = [encode(GenerateRequest(f"ok{i}", REPLY, input_ids=[1])) for i in range(3)]
    wrong_kind = encode(TokenizedRequest("named", REPLY, [1]))  # names its requester
    entry_id = _bundle(redis_client, config.requests_stream(),
                       [good[0], b"\xc1 not msgpack", good[1], wrong_kind, good[2]])  # fmt: skip
    assert actor.run_once() == 1
    rids = [decode(p, TokenizedRequest).rid for p in _jobs(redis_client, config.tokenized_stream())]
    assert rids == ["ok0", "ok1", "ok2"]
    dead = _dead_letters(redis_client, config)
    assert [d["entry_id"] for d in dead] == [entry_id, entry_id]
    assert [d["payload"] for d in dead] == [b"\xc1 not msgpack", wrong_kind]
    assert all(d["reason"] for d in dead)
    assert [(r.rid, r.status) for r in _replies(redis_client)] == [("named", 400)]
    assert redis_client.xpending(config.requests_stream(), "tokenizer")["pending"] == 0


@pytest.mark.parametrize("name", MALFORMED_BUNDLES)
def test_a_malformed_bundle_is_dead_lettered_whole_and_the_stage_goes_on(
    redis_client, config, name
):
    fields, reason = MALFORMED_BUNDLES[name]
    actor = _tokenizer(redis_client, config)
    entry_id = redis_client.xadd(config.requests_stream(), fields)
    redis_client.xadd(config.requests_stream(), {ENTRY_FIELD: encode(
        GenerateRequest("after", REPLY, input_ids=[1]))})  # fmt: skip
    assert actor.run_once() == 2
    (dead,) = _dead_letters(redis_client, config)
    assert dead["entry_id"] == entry_id and reason in dead["reason"].decode()
    assert dead["payload"] == fields[JOBS_FIELD]
    rids = [decode(p, TokenizedRequest).rid for p in _jobs(redis_client, config.tokenized_stream())]
    assert rids == ["after"]
    assert redis_client.xpending(config.requests_stream(), "tokenizer")["pending"] == 0


# ---- poison safety: a bundle claimed after a delivery is split ---------------------------------


class RecordingStage:
    """Echoes each TokenizedRequest onto its reply stream; a rid starting ``boom`` makes
    `handle` raise, as a stage bug would."""

    group = "echo"
    accepts = (TokenizedRequest,)

    def __init__(self) -> None:
        self.handled: list[str] = []

    def input_stream(self, config: BusConfig) -> str:
        return f"{config.stream_prefix}:echo-in"

    def handle(self, batch: list[Inbound]) -> list[Output]:
        if any(inbound.message.rid.startswith("boom") for inbound in batch):
            raise ValueError("boom")
        self.handled.extend(inbound.message.rid for inbound in batch)
        return [Outbound(m.reply_to, TextDelta(m.rid, 0, m.input_ids, "echo"))
                for m in (inbound.message for inbound in batch)]  # fmt: skip


def test_a_bundle_left_by_a_dead_consumer_is_split_into_single_entries_then_handled(
    redis_client, config
):
    stage = RecordingStage()
    stream = stage.input_stream(config)
    ensure_group(redis_client, stream, stage.group)
    rids = ["a", "boom-b", "c", "d"]
    bundle_id = _bundle(redis_client, stream,
                        [encode(TokenizedRequest(rid, REPLY, [1])) for rid in rids])  # fmt: skip
    # A consumer reads it and dies holding it.
    redis_client.xreadgroup(stage.group, "dead-consumer", {stream: ">"}, count=10)
    time.sleep(config.claim_idle_ms / 1000 + 0.05)
    actor = Actor(redis_client, config, stage)
    # Claimed (its second delivery) and split in one MULTI, then the jobs read as entries
    # of their own, each with its own delivery count.
    assert actor.run_once() == 4
    entries = redis_client.xrange(stream)
    assert entries[0][0] == bundle_id  # acknowledged (not yet trimmed)
    assert [list(fields) for _, fields in entries[1:]] == [[ENTRY_FIELD]] * 4
    assert [decode(f[ENTRY_FIELD], TokenizedRequest).rid for _, f in entries[1:]] == rids
    assert stage.handled == ["a", "c", "d"]
    (dead,) = _dead_letters(redis_client, config)  # the job the stage fails on, alone
    assert b"boom" in dead["reason"]
    assert decode(dead["payload"], TokenizedRequest).rid == "boom-b"
    assert redis_client.xpending(stream, stage.group)["pending"] == 0


def test_a_bundle_whose_job_makes_the_stage_raise_loses_none_of_its_mates(redis_client, config):
    stage = RecordingStage()
    stream = stage.input_stream(config)
    ensure_group(redis_client, stream, stage.group)
    entry_id = _bundle(redis_client, stream, [encode(TokenizedRequest(rid, REPLY, [1]))
                                              for rid in ("a", "boom", "c")])  # fmt: skip
    actor = Actor(redis_client, config, stage)
    assert actor.run_once() == 1
    assert stage.handled == ["a", "c"]
    (dead,) = _dead_letters(redis_client, config)
    assert dead["entry_id"] == entry_id
    assert {r.rid: type(r) for r in _replies(redis_client)} == {
        "a": TextDelta, "c": TextDelta, "boom": ErrorReply}  # fmt: skip
