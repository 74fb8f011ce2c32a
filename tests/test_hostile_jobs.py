"""A hostile client against the whole running system: a corpus of malformed and oversized
jobs, sent over HTTP and straight onto every stream a client may write (requests,
tokenized, a worker's own stream). Each gets a clear answer — a 4xx with an OpenAI-style
body over HTTP, an ErrorReply on its ``reply_to`` on the bus, or, where no ``reply_to`` can
be read from the entry, a dead letter with its reason — every process of `streamserve up`
is still the one that started, and a normal request is served afterwards.
"""

from __future__ import annotations

import json
import struct
import time
import urllib.request
import zlib
from typing import Any

import msgpack
import pytest
import redis

from jobs.protocol import ENTRY_FIELD, JOBS_FIELD, ErrorReply, TextDelta, decode
from tests.pipeline_harness import Pipeline

MODEL = "smollm2-135m-instruct"
ANSWER_TIMEOUT_S = 120.0
DEEP = "[" * 100_000


class Fields(dict):
    """A corpus entry written with exactly these fields (not a payload under ``m``)."""


def _ids(*ids: int) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


def _job(kind: str, rid: str, **fields: Any) -> dict[str, Any]:
    job = {"kind": kind, "rid": rid, "reply_to": "hostile:replies", "sampling": {}, **fields}
    return {name: value for name, value in job.items() if value is not None}


def _generate(rid: str, **fields: Any) -> dict[str, Any]:
    return _job("generate", rid, **({"prompt": "Hi"} | fields))


def _tokenized(rid: str, **fields: Any) -> dict[str, Any]:
    return _job("tokenized", rid, **({"input_ids": _ids(1, 2, 3)} | fields))


def _sampling(**params: Any) -> dict[str, Any]:
    return {"sampling": {"max_new_tokens": 4, **params}}


# (target, name, the map or bytes written). Maps that name their requester must be answered.
STREAM_CORPUS: list[tuple[str, str, Any]] = [
    ("requests", "prompt-map", _generate("r-prompt-map", prompt={"a": 1})),
    ("requests", "prompt-list", _generate("r-prompt-list", prompt=["a"])),
    ("requests", "messages-str", _generate("r-messages-str", prompt=None, messages="hi")),
    ("requests", "messages-ints", _generate("r-messages-ints", prompt=None, messages=[1, 2])),
    ("requests", "message-content-map",
     _generate("r-content-map", prompt=None, messages=[{"role": "user", "content": {"x": 1}}])),
    ("requests", "message-role-int",
     _generate("r-role-int", prompt=None, messages=[{"role": 7, "content": "x"}])),
    ("requests", "messages-deep",
     _generate("r-messages-deep", prompt=None,
               messages=[{"role": "user", "content": json.loads("[" * 500 + "]" * 500)}])),
    ("requests", "no-prompt", _generate("r-no-prompt", prompt=None)),
    ("requests", "two-prompts", _generate("r-two-prompts", input_ids=_ids(1, 2))),
    ("requests", "ids-as-list", _generate("r-ids-list", prompt=None, input_ids=[1, 2, 3])),
    ("requests", "ids-odd-bytes", _generate("r-ids-odd", prompt=None, input_ids=b"\x01\x02\x03")),
    ("requests", "sampling-list", _generate("r-sampling-list", sampling=[1, 2])),
    ("requests", "temperature-str", _generate("r-temp-str", **_sampling(temperature="hot"))),
    ("requests", "max-tokens-huge", _generate("r-max-huge", **_sampling(max_new_tokens=2**63 - 1))),
    ("requests", "max-tokens-negative", _generate("r-max-neg", **_sampling(max_new_tokens=-1))),
    ("requests", "top-k-float", _generate("r-top-k", **_sampling(top_k=1e308))),
    ("requests", "seed-huge", _generate("r-seed", **_sampling(seed=2**64 - 1))),
    ("requests", "schema-deep", _generate("r-schema-deep", **_sampling(json_schema=DEEP))),
    ("requests", "regex-bad", _generate("r-regex", **_sampling(regex="(((("))),
    ("requests", "ebnf-bad", _generate("r-ebnf", **_sampling(ebnf="root ::= ("))),
    ("requests", "stop-many", _generate("r-stop-many", **_sampling(stop=["x"] * 10_000))),
    ("requests", "stop-long", _generate("r-stop-long", **_sampling(stop=["y" * 1_000_000]))),
    ("requests", "logit-bias-vocab",
     _generate("r-bias-vocab", **_sampling(logit_bias={str(i): 1.0 for i in range(49_152)}))),
    ("requests", "logit-bias-keys", _generate("r-bias-keys", **_sampling(logit_bias={"a": 1}))),
    ("requests", "unknown-param", _generate("r-unknown", **_sampling(frobnicate=1))),
    ("requests", "weight-negative", _generate("r-weight", weight=-1.0)),
    ("requests", "tools-without-chat", _generate("r-tools", tools=[{"type": "function"}])),
    ("requests", "unknown-kind", _job("frobnicate", "r-unknown-kind")),
    ("requests", "rid-int", {"kind": "generate", "rid": 5, "reply_to": "x", "prompt": "Hi"}),
    ("requests", "reply-to-list", {"kind": "generate", "rid": "r", "reply_to": [1], "prompt": "x"}),
    ("requests", "not-a-map", [1, 2, 3]),
    ("requests", "truncated-msgpack", msgpack.packb(_generate("r-truncated"))[:-7]),
    ("requests", "not-msgpack", b"\xc1\xc1 not msgpack"),
    # Deflated payloads are the token and reply streams' only: refused here, never inflated.
    ("requests", "deflated", zlib.compress(msgpack.packb(_generate("r-deflated")))),
    ("worker", "deflated-bomb", zlib.compress(bytes(2**24), 9)),
    ("tokenized", "ids-empty", _tokenized("t-empty", input_ids=b"")),
    ("tokenized", "ids-past-vocab", _tokenized("t-vocab", input_ids=_ids(10**9))),
    ("tokenized", "ids-negative", _tokenized("t-negative", input_ids=_ids(-5, 3))),
    # Narrow ids (jobs/wire.py) of another extension type or an odd length, and bad tags.
    ("requests", "ids-ext-other-type", _generate("r-ids-ext", prompt=None,
                                                 input_ids=msgpack.ExtType(5, b"\x01\x00"))),
    ("tokenized", "ids-ext-odd", _tokenized("t-ids-ext-odd",
                                            input_ids=msgpack.ExtType(2, b"\x01\x00\x02"))),
    ("worker", "progress-ext-odd", _tokenized("w-progress-ext", progress=msgpack.ExtType(2, b"1"))),
    ("tokenized", "tag-negative", _tokenized("t-tag", tag=-1, bundle_replies=True)),
    ("worker", "tag-str", _tokenized("w-tag", tag="7", bundle_replies=True)),
    ("tokenized", "prompt-past-context", _tokenized("t-context", input_ids=_ids(*[7] * 20_000))),
    ("tokenized", "schema-deep", _tokenized("t-schema", **_sampling(json_schema=DEEP))),
    ("tokenized", "top-logprobs-huge", _tokenized("t-top", **_sampling(logprobs=True,
                                                                       top_logprobs=10**6))),
    ("tokenized", "priority-huge", _tokenized("t-priority", **_sampling(priority=2**40))),
    ("tokenized", "priority-twice", _tokenized("t-priority-twice", priority=1,
                                               **_sampling(priority=2))),
    ("requests", "version-unknown", _generate("r-version", v=99)),
    ("requests", "version-str", _generate("r-version-str", v="2")),
    ("tokenized", "attempts-negative", _tokenized("t-attempts", attempts=-3)),
    ("tokenized", "sampling-map-keys", _tokenized("t-keys", sampling={1: 2})),
    ("worker", "schema-deep", _tokenized("w-schema", **_sampling(json_schema=DEEP))),
    ("worker", "no-ids", {"kind": "tokenized", "rid": "w-no-ids", "reply_to": "hostile:replies"}),
    ("worker", "logprobs-str", _tokenized("w-logprobs", **_sampling(logprobs="yes"))),
    ("worker", "abort-rid-int", {"kind": "abort", "rid": 5}),
    ("worker", "stop-token-ids-huge",
     _tokenized("w-stop-ids", **_sampling(stop_token_ids=[2**40]))),
    # Bundles of jobs (jobs/wire.py) that are not one: each dead-lettered whole.
    ("requests", "bundle-not-array", Fields({JOBS_FIELD: msgpack.packb(_generate("r-b-map"))})),
    ("requests", "bundle-empty", Fields({JOBS_FIELD: msgpack.packb([])})),
    ("requests", "bundle-maps-inside", Fields({JOBS_FIELD: msgpack.packb([_generate("r-b")])})),
    ("tokenized", "bundle-too-many", Fields({JOBS_FIELD: msgpack.packb([b"\x80"] * 5000)})),
    ("tokenized", "bundle-deflated", Fields({JOBS_FIELD: zlib.compress(msgpack.packb(
        [msgpack.packb(_tokenized("t-b-deflated"))]))})),
    ("tokenized", "bundle-and-m", Fields({ENTRY_FIELD: msgpack.packb(_tokenized("t-b-m")),
                                          JOBS_FIELD: msgpack.packb([b"\x80", b"\x80"])})),
    ("requests", "bundle-not-msgpack", Fields({JOBS_FIELD: b"\xc1\xc1"})),
    # A worker reads bundles (a router batch's jobs for it): a malformed one is dead-lettered
    # whole, a bad job in a good one alone (the good one runs).
    ("worker", "bundle-not-msgpack", Fields({JOBS_FIELD: b"\xc1\xc1"})),
    ("worker", "bundle-with-a-bad-job",
     Fields({JOBS_FIELD: msgpack.packb([msgpack.packb(_tokenized("w-b", **_sampling())),
                                        b"\x80"])})),
]  # fmt: skip

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
HTTP_CORPUS: list[tuple[str, str, Any]] = [
    ("/generate", "schema-deep", {"text": "Hi", "sampling_params": {"json_schema": DEEP}}),
    ("/generate", "temperature-str", {"text": "Hi", "sampling_params": {"temperature": "x"}}),
    ("/generate", "text-map", {"text": {"a": 1}}),
    ("/generate", "body-deep", "[" * 100_000 + "]" * 100_000),
    ("/generate", "not-json", "{not json"),
    (CHAT, "messages-str", {"model": MODEL, "messages": "hi"}),
    (CHAT, "stop-many", {"model": MODEL, "messages": USER, "stop": ["x"] * 10_000}),
    (CHAT, "n-huge", {"model": MODEL, "messages": USER, "n": 10**9}),
    (CHAT, "bias-huge",
     {"model": MODEL, "messages": USER, "logit_bias": {str(i): 1 for i in range(49_152)}}),
    (CHAT, "schema-deep",
     {"model": MODEL, "messages": USER,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}}),
    ("/v1/completions", "prompt-map", {"model": MODEL, "prompt": {"a": 1}}),
    ("/v1/completions", "max-tokens-huge", {"model": MODEL, "prompt": "Hi", "max_tokens": 10**30}),
]  # fmt: skip


@pytest.fixture(scope="module")
def pipeline():
    with Pipeline(MODEL) as running:
        yield running


def _write(client: redis.Redis, stream: str, payload: Any) -> bytes:
    if isinstance(payload, Fields):
        return client.xadd(stream, payload)
    data = payload if isinstance(payload, bytes) else msgpack.packb(payload, use_bin_type=True)
    return client.xadd(stream, {ENTRY_FIELD: data})


def _requester(payload: Any) -> str | None:
    """The rid an entry names with a string reply_to: the entries that must be answered."""
    if isinstance(payload, dict) and isinstance(payload.get("reply_to"), str):
        rid = payload.get("rid")
        return rid if isinstance(rid, str) else None
    return None


def _answers(client: redis.Redis) -> dict[str, list[Any]]:
    answers: dict[str, list[Any]] = {}
    for _, fields in client.xrange("hostile:replies"):
        reply = decode(fields[ENTRY_FIELD], ErrorReply, TextDelta)
        answers.setdefault(reply.rid, []).append(reply)
    return answers


def _post(url: str, body: Any) -> tuple[int, Any]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def test_every_hostile_job_is_answered_and_every_process_lives(pipeline):
    assert len(STREAM_CORPUS) + len(HTTP_CORPUS) >= 40
    client = redis.Redis.from_url(pipeline.redis_url)
    config = pipeline.config
    replicas = {needle: pipeline.replica_pids(needle) for needle in ("gpu_worker", "stage")}
    (worker_stream,) = {w.decode() for w in client.smembers(config.workers_key())}
    streams = {
        "requests": config.requests_stream(),
        "tokenized": config.tokenized_stream(),
        "worker": config.worker_stream(worker_stream),
    }
    sent: dict[str, tuple[str, str, bytes]] = {}  # name -> (stream, rid or "", entry id)
    for target, name, payload in STREAM_CORPUS:
        entry_id = _write(client, streams[target], payload)
        sent[f"{target}/{name}"] = (streams[target], _requester(payload) or "", entry_id)
    for path, name, body in HTTP_CORPUS:
        status, answer = _post(pipeline.url + path, body)
        assert 400 <= status < 500, (path, name, status, answer)
        assert answer["error"]["message"] and answer["error"]["type"], (path, name, answer)

    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while True:
        answers = _answers(client)
        dead = {(f[b"source"].decode(), f[b"entry_id"]) for _, f in
                client.xrange(config.dead_letter_stream())}  # fmt: skip
        missing = [
            name for name, (stream, rid, entry_id) in sent.items()
            if not (rid in answers if rid else (stream, entry_id) in dead)
        ]  # fmt: skip
        # The good job of a bundle holding a bad one runs to its end.
        if not any(isinstance(a, TextDelta) and a.finish for a in answers.get("w-b", [])):
            missing.append("worker/bundle-with-a-bad-job's good job")
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"never answered: {missing}"
    for name, (_, rid, _) in sent.items():
        if rid:
            assert [type(a) for a in answers[rid]] == [ErrorReply], (name, answers[rid])
            assert 400 <= answers[rid][0].status < 500, (name, answers[rid][0])
    for reason in (f[b"reason"] for _, f in client.xrange(config.dead_letter_stream())):
        assert reason
    # No process died or was restarted, and the system serves on.
    assert {n: pipeline.replica_pids(n) for n in replicas} == replicas
    status, body = pipeline.post("/generate", {"text": "Hello", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}})  # fmt: skip
    assert status == 200 and body["meta_info"]["completion_tokens"] == 4


def _raw_replies(client: redis.Redis, stream: str, rids: set[str]) -> dict[str, list[dict]]:
    """The reply entries as a client with no streamserve code reads them: msgpack maps."""
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while True:
        replies: dict[str, list[dict]] = {}
        for _, fields in client.xrange(stream):
            reply = msgpack.unpackb(fields[ENTRY_FIELD], raw=False)
            replies.setdefault(reply["rid"], []).append(reply)
        done = {r for r, got in replies.items() if any(m.get("finish") for m in got)}
        if rids <= done or time.monotonic() > deadline:
            return replies
        time.sleep(0.2)


def test_a_direct_job_written_by_an_older_client_is_served_in_its_own_version(pipeline):
    # Not hostile: a job as a client before wire version 2 wrote it (no `v`, priority inside
    # sampling) is served like a current one, and its replies keep the form it reads.
    client = redis.Redis.from_url(pipeline.redis_url)
    config = pipeline.config
    sampling = {"max_new_tokens": 4, "temperature": 0}
    old = {"kind": "generate", "rid": "old-client", "reply_to": "older:replies",
           "prompt": "Hello", "sampling": {**sampling, "priority": 1}}  # fmt: skip
    old_ids = {"kind": "tokenized", "rid": "old-client-ids", "reply_to": "older:replies",
               "input_ids": _ids(1, 2, 3), "sampling": {**sampling, "priority": 1}}  # fmt: skip
    new = {**old, "rid": "new-client", "v": 2, "priority": 1, "sampling": sampling}
    _write(client, config.requests_stream(), old)
    _write(client, config.tokenized_stream(), old_ids)
    _write(client, config.requests_stream(), new)
    replies = _raw_replies(client, "older:replies", {"old-client", "old-client-ids", "new-client"})
    finishes = {rid: next(m["finish"] for m in got if m.get("finish")) for rid, got in
                replies.items()}  # fmt: skip
    assert set(finishes) == {"old-client", "old-client-ids", "new-client"}, replies
    # Version 1's finish: [reason, matched, prompt_tokens, completion_tokens, cached_tokens].
    for rid in ("old-client", "old-client-ids"):
        assert isinstance(finishes[rid], list) and len(finishes[rid]) == 5, finishes[rid]
        assert finishes[rid][0] == "length" and finishes[rid][3] == 4
    assert finishes["new-client"]["reason"] == "length"
    assert finishes["new-client"]["completion_tokens"] == 4

    def text(rid: str) -> str:
        return "".join(m.get("text") or "" for m in sorted(replies[rid], key=lambda m: m["seq"]))

    assert text("old-client") == text("new-client")  # the same job, greedy, in either version
