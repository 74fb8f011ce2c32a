"""Wire records by name, with a version: what version 2 writes, that version 1 (the
positional lists of older workers and clients) still reads, and that a newer version is
refused with a reason rather than misread."""

from __future__ import annotations

import msgpack
import pytest

from jobs.legacy_records import finish_as_list
from jobs.protocol import (
    WIRE_VERSION,
    Finish,
    ProtocolError,
    TextDelta,
    TokenBatch,
    TokenItem,
    decode,
    encode,
    pack_ids,
)
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage


def _item(**changes: object) -> TokenItem:
    fields = dict(rid="r", reply_to="q", start=0, ids=[5, 6], context=[1, 2], prompt_context=2)
    return TokenItem(**{**fields, **changes})


def test_a_token_batch_is_written_by_name_with_its_version():
    wire = TokenBatch("w", 3, [_item(finish=Finish("stop", "x", 2, 2))]).to_wire()
    assert wire["v"] == WIRE_VERSION == 2
    item = wire["items"][0]
    assert isinstance(item, dict) and item["rid"] == "r" and item["start"] == 0
    assert item["finish"] == {"reason": "stop", "matched": "x", "prompt_tokens": 2,
                              "completion_tokens": 2, "cached_tokens": 0}  # fmt: skip
    # Defaults stay off the wire: no stop strings, specials skipped, the current version.
    assert not {"stop", "skip_special_tokens", "reply_version", "logprobs"} & set(item)


def test_named_records_round_trip_every_field():
    item = _item(stop=["\n"], skip_special_tokens=False, logprobs=[-0.5, -1.0],
                 top_logprobs=[[[5, -0.5]], [[6, -1.0]]], prompt_ids=[1, 2],
                 prompt_logprobs=[None, -2.0], prompt_top_logprobs=[None, [[2, -2.0]]],
                 reply_version=1,
                 finish=Finish("length", None, 2, 2, 1, 4, 3, queue_seconds=0.5))  # fmt: skip
    batch = TokenBatch("w", 1, [item])
    assert decode(encode(batch), TokenBatch) == batch


def test_a_batch_of_an_older_worker_still_decodes():
    old = {"kind": "tokens", "worker_id": "w", "step": 1, "items": [
        ["r", "q", 0, pack_ids([5]), pack_ids([1]), 1, [], True, ["stop", None, 1, 1, 0],
         None, None],
    ]}  # fmt: skip
    batch = decode(msgpack.packb(old), TokenBatch)
    assert batch.v == 1 and batch.items[0].finish == Finish("stop", None, 1, 1)
    # Its requester is presumed as old as it: replies keep the list form.
    assert batch.items[0].reply_version == 1


@pytest.mark.parametrize("version", [3, 0, "2", True])
def test_a_version_this_reader_does_not_know_is_refused_with_the_reason(version):
    wire = TokenBatch("w", 1, [_item()]).to_wire()
    wire["v"] = version
    with pytest.raises(ProtocolError, match="'v' must be int|version (3|0) is not one"):
        decode(msgpack.packb(wire), TokenBatch)


def test_an_item_asking_replies_in_an_unknown_version_is_refused():
    wire = TokenBatch("w", 1, [_item()]).to_wire()
    wire["items"][0]["reply_version"] = 9
    with pytest.raises(ProtocolError, match="reply_version"):
        decode(msgpack.packb(wire), TokenBatch)


def test_a_finish_decodes_from_either_form_alike():
    finish = Finish("stop", 7, 10, 4, 3, draft_tokens=6, accepted_draft_tokens=5)
    assert Finish.from_wire(finish.to_wire()) == finish
    assert Finish.from_wire(finish_as_list(finish)) == finish
    with pytest.raises(ProtocolError, match="finish.completion_tokens"):
        Finish.from_wire({"reason": "stop", "prompt_tokens": 1})
    with pytest.raises(ProtocolError, match="finish.matched"):
        Finish.from_wire({"reason": "stop", "matched": 1.5, "prompt_tokens": 1,
                          "completion_tokens": 1})  # fmt: skip


@pytest.mark.parametrize("reply_version, form", [(2, dict), (1, list)])
def test_the_detokenizer_writes_the_finish_in_the_requesters_version(reply_version, form):
    stage = DetokenizerStage(config=None, tokenizer=None)
    finish = Finish("length", None, 2, 2)
    delta = stage._delta(_item(finish=finish, reply_version=reply_version), None)
    assert isinstance(delta.finish, form)
    decoded = decode(encode(delta), TextDelta)
    assert decoded.finish_info() == finish


def test_a_requests_first_delta_names_the_weights_of_its_batch():
    # The worker's batch names the weights computing it; the detokenizer copies the version
    # onto each request's first delta (start 0) only, so a stream names it from its first
    # chunk without a field on every delta. A batch of a worker naming none names nothing.
    from bus.actor import Inbound

    stage = DetokenizerStage(config=BusConfig(), tokenizer=None)
    batch = TokenBatch("w", 3, [_item(rid="a"), _item(rid="b", start=4)], weights="w2-abcd")
    older = TokenBatch("w", 4, [_item(rid="c")])
    batch = decode(encode(batch), TokenBatch)
    assert batch.weights == "w2-abcd" and decode(encode(older), TokenBatch).weights is None
    outputs = stage.handle([Inbound(b"1-0", batch), Inbound(b"2-0", older)])
    deltas = {out.message.rid: out.message for out in outputs if hasattr(out, "message")}
    named = {rid: decode(encode(delta), TextDelta).weights_version for rid, delta in deltas.items()}
    assert named == {"a": "w2-abcd", "b": None, "c": None}
