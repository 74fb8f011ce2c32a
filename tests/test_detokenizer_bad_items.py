"""A token batch holds many requests' tokens: an item the detokenizer cannot wholly handle
(ids no tokenizer decodes, logprobs of another shape) goes without what failed, one that
does not read ends its request with an error, and its batch-mates go through untouched.
Raised, either dead-lettered the whole entry, and every request in it waited for tokens
that never came. On a real server, with the real tokenizer and a real detokenizer Actor."""

from __future__ import annotations

import msgpack
import pytest

import jobs.protocol as wire
from bus.actor import Actor
from bus.reconnect import ensure_group
from jobs.model_tokenizer import load_model_tokenizer
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage

REPLY = "t:reply:ingress"


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_tokenizer("smollm2-135m-instruct")


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=20)


def _deltas(client) -> list[wire.TextDelta]:
    found = []
    for _, fields in client.xrange(REPLY):
        message = wire.decode(fields[wire.ENTRY_FIELD], wire.TextDeltas, wire.TextDelta,
                              wire.ErrorReply)  # fmt: skip
        if not isinstance(message, wire.ErrorReply):
            found.extend(message.deltas if isinstance(message, wire.TextDeltas) else [message])
    return found


def test_an_item_that_fails_goes_without_what_failed_and_its_batch_mates_go_through(
    redis_client, config, tokenizer
):
    hello = tokenizer.encode("Hello there", add_special_tokens=False)
    finish = wire.Finish("length", None, 3, 2)
    items = [
        wire.TokenItem("good", REPLY, 0, hello, []),
        wire.TokenItem("negative", REPLY, 0, [-5, hello[0]], []),  # no tokenizer decodes it
        wire.TokenItem("tops", REPLY, 0, hello, [], logprobs=[-0.5] * len(hello),
                       top_logprobs=[[[7]]] * len(hello)),  # pairs without their logprob
        wire.TokenItem(None, REPLY, 4, [-1], [], finish=finish, bundle=True, tag=3),
    ]  # fmt: skip
    stage = DetokenizerStage(config, tokenizer)
    stream = stage.input_stream(config)
    ensure_group(redis_client, stream, stage.group)
    actor = Actor(redis_client, config, stage)
    redis_client.xadd(stream, {wire.ENTRY_FIELD: wire.encode(wire.TokenBatch("w1", 1, items))})
    while actor.run_once():
        pass
    assert actor.dead_lettered == 0
    assert redis_client.xpending(stream, stage.group)["pending"] == 0
    by_name = {d.rid if d.rid is not None else d.tag: d for d in _deltas(redis_client)}
    assert set(by_name) == {"good", "negative", "tops", 3}
    assert by_name["good"].text == "Hello there"
    assert (by_name["negative"].text, by_name["negative"].ids) == ("", [-5, hello[0]])
    tops = by_name["tops"]  # its logprobs dropped: an ingress could not have shown them
    assert (tops.text, tops.logprobs, tops.top_logprobs) == ("Hello there", None, None)
    assert (by_name[3].seq, by_name[3].text) == (4, "")  # its finish still ends its request
    assert wire.Finish.from_wire(by_name[3].finish).reason == "length"


def test_an_item_that_does_not_read_ends_its_request_and_its_batch_mates_go_through(
    redis_client, config, tokenizer
):
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    items = [wire.TokenItem(rid, REPLY, 0, hello, []) for rid in ("good", "bad", "unnamed")]
    data = msgpack.unpackb(wire.encode(wire.TokenBatch("w1", 1, items)))
    data["items"][1]["prompt_context"] = 99  # more than its context holds
    del data["items"][2]["rid"]  # no tag either: nobody can be told
    stage = DetokenizerStage(config, tokenizer)
    stream = stage.input_stream(config)
    ensure_group(redis_client, stream, stage.group)
    actor = Actor(redis_client, config, stage)
    redis_client.xadd(stream, {wire.ENTRY_FIELD: msgpack.packb(data)})
    while actor.run_once():
        pass
    assert actor.dead_lettered == 0
    replies = [wire.decode(f[wire.ENTRY_FIELD], wire.TextDeltas, wire.TextDelta, wire.ErrorReply)
               for _, f in redis_client.xrange(REPLY)]  # fmt: skip
    (error,) = [r for r in replies if isinstance(r, wire.ErrorReply)]
    assert (error.rid, error.status, error.code) == ("bad", 500, "unreadable_tokens")
    assert "prompt_context" in error.message
    assert [d.rid for d in _deltas(redis_client)] == ["good"]
    # A batch of which nothing reads is a malformed entry, set aside as before.
    del data["items"][0]["rid"]
    data["items"][1:] = []
    redis_client.xadd(stream, {wire.ENTRY_FIELD: msgpack.packb(data)})
    while actor.run_once():
        pass
    assert actor.dead_lettered == 1
