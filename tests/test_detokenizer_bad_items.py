"""A token batch holds many requests' tokens: an item the detokenizer cannot wholly handle
(ids no tokenizer decodes, logprobs of another shape) goes without what failed, and its
batch-mates go through untouched. Raised, it dead-lettered the whole entry, and every
request in it waited for tokens that never came. On a real server, with the real tokenizer
and a real detokenizer Actor."""

from __future__ import annotations

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
        message = wire.decode(fields[wire.ENTRY_FIELD], wire.TextDeltas, wire.TextDelta)
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
