"""Jobs named by tags on the tokens stream and in bundled replies (bus/reply_tags.py).

A bundled job with a ``tag`` is named by it in its token items and its TextDeltas, and by
its rid too only at output index 0. Its reader routes tag-only deltas to the rid it gave the
tag; a reader replaying a stream it did not submit to (a resumed request) learns each tag
from the request's first delta, holding the deltas that raced ahead of it. A job without a
tag, a plain delta and an older entry with rids read as before; a malformed tag, or an item
named by a tag alone that is not bundled, is a ProtocolError (a dead letter).
"""

from __future__ import annotations

import msgpack
import pytest

from bus.actor import Inbound
from bus.reply_router import ReplyRouter
from bus.reply_tags import MAX_UNNAMED, ReplyTags
from jobs.protocol import ENTRY_FIELD, TextDelta, TextDeltas, TokenBatch, decode
from jobs.requests import GenerateRequest, TokenizedRequest
from jobs.token_records import Finish, TokenItem
from jobs.wire import ProtocolError, encode
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage

REPLY = "streamserve:reply:ingress-1"
RID = "0123456789abcdef0123456789abcdef-0"
FINISH = Finish("stop", None, 3, 4)


def _item(start: int, tag: int | None = 7, bundle: bool = True, **fields) -> TokenItem:
    return TokenItem(RID, REPLY, start, [start + 1], [5, 6], bundle=bundle, tag=tag, **fields)


def _wire_items(*items: TokenItem) -> list[dict]:
    return msgpack.unpackb(encode(TokenBatch("w", 1, list(items))), raw=False)["items"]


def test_jobs_carry_their_tag_through_every_hop():
    generate = GenerateRequest(RID, REPLY, prompt="hi", bundle_replies=True, tag=7)
    assert decode(encode(generate), GenerateRequest).tag == 7
    tokenized = TokenizedRequest(RID, REPLY, [1, 2], {}, bundle_replies=True, tag=2**40)
    assert decode(encode(tokenized), TokenizedRequest).tag == 2**40


@pytest.mark.parametrize("tag", [-1, 2**63])
def test_a_job_with_a_tag_out_of_range_is_refused_naming_it(tag):
    wire = {"kind": "tokenized", "rid": "r", "reply_to": REPLY, "sampling": {},
            "input_ids": b"", "tag": tag}  # fmt: skip
    with pytest.raises(ProtocolError) as raised:
        decode(msgpack.packb(wire), TokenizedRequest)
    assert raised.value.field == "tag" or "tag" in str(raised.value)


def test_a_tagged_item_names_its_rid_only_at_output_index_zero():
    first, later = _wire_items(_item(0), _item(4))
    assert (first["rid"], first["tag"]) == (RID, 7)
    assert "rid" not in later and later["tag"] == 7
    read = decode(encode(TokenBatch("w", 1, [_item(0), _item(4)])), TokenBatch).items
    assert [(item.rid, item.tag) for item in read] == [(RID, 7), (None, 7)]


def test_an_untagged_or_unbundled_item_keeps_its_rid():
    (untagged,) = _wire_items(_item(4, tag=None))
    assert untagged["rid"] == RID and "tag" not in untagged
    (unbundled,) = _wire_items(_item(4, bundle=False))  # its reader takes no tag alone
    assert unbundled["rid"] == RID
    read = decode(encode(TokenBatch("w", 1, [_item(4, bundle=False)])), TokenBatch).items
    assert [item.rid for item in read] == [RID]


@pytest.mark.parametrize(
    "item, reason",
    [
        ({"start": 4, "ids": b"", "context": b""}, "'rid' is missing"),
        ({"start": 4, "ids": b"", "context": b"", "tag": 3}, "must be bundled"),
        ({"start": 4, "ids": b"", "context": b"", "tag": -3, "bundle": True}, "tag"),
        ({"start": 4, "ids": b"", "context": b"", "tag": "3", "bundle": True}, "tag"),
    ],
)
def test_a_malformed_tagged_item_is_a_protocol_error(item, reason):
    batch = {"kind": "tokens", "worker_id": "w", "step": 1, "v": 2,
             "items": [{"reply_to": REPLY, **item}]}  # fmt: skip
    with pytest.raises(ProtocolError, match=reason):
        decode(msgpack.packb(batch), TokenBatch)


def test_the_detokenizer_names_bundled_deltas_by_tag_and_plain_ones_by_rid():
    stage = DetokenizerStage(BusConfig(), None)
    batch = TokenBatch("w", 1, [_item(0), _item(4, finish=FINISH)])
    read = decode(encode(batch), TokenBatch)
    outputs = stage.handle([Inbound(b"1-0", read)])
    bundle = next(out.message for out in outputs if isinstance(getattr(out, "message", None),
                                                              TextDeltas))  # fmt: skip
    wire = msgpack.unpackb(encode(bundle), raw=False)["deltas"]
    assert (wire[0]["rid"], wire[0]["tag"]) == (RID, 7)
    assert "rid" not in wire[1] and wire[1]["tag"] == 7
    # The first names the worker computing it, for its ingress's aborts (bus/aborts.py).
    assert wire[0]["worker"] == "w" and "worker" not in wire[1]
    plain = TextDelta(RID, 4, [1], "x", tag=7)
    assert msgpack.unpackb(encode(plain), raw=False)["rid"] == RID


@pytest.mark.parametrize("tag", [-1, "7", 2**64 - 1])
def test_a_delta_with_a_malformed_tag_is_a_protocol_error(tag):
    wire = {"kind": "deltas", "deltas": [{"seq": 1, "ids": b"", "text": "x", "tag": tag}]}
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(wire), TextDeltas)


def test_a_delta_named_by_nothing_is_a_protocol_error():
    wire = {"kind": "deltas", "deltas": [{"seq": 1, "ids": b"", "text": "x"}]}
    with pytest.raises(ProtocolError, match="'rid' is missing"):
        decode(msgpack.packb(wire), TextDeltas)


def _entry(*deltas: TextDelta) -> dict[bytes, bytes]:
    return {ENTRY_FIELD: encode(TextDeltas(list(deltas)))}


def _routed(router: ReplyRouter, *entries: dict[bytes, bytes]) -> list[tuple[str, int]]:
    numbered = [(f"{i + 1}-0".encode(), fields) for i, fields in enumerate(entries)]
    return [(rid, message.seq) for rid, message in router.route(numbered)]


def test_the_reader_that_gave_the_tags_routes_tag_only_deltas():
    router = ReplyRouter(REPLY)
    router.register("a")
    router.register("b")
    tag_a, tag_b = router.tag("a"), router.tag("b")
    assert tag_a != tag_b
    later_b = TextDelta(None, 1, [2], "y", tag=tag_b)
    assert _routed(router, _entry(later_b, TextDelta("a", 0, [1], "x", tag=tag_a)),
                   _entry(TextDelta("b", 0, [1], "x", tag=tag_b))) == [
        ("a", 0), ("b", 0), ("b", 1)
    ]  # fmt: skip


def test_a_resumed_reader_learns_a_tag_from_the_first_delta_and_files_those_ahead_of_it():
    router = ReplyRouter(REPLY)
    router.register("a")  # a resumed request: its tag was given by a reader now gone
    raced_ahead = TextDelta(None, 1, [2], "y", tag=5)
    other = TextDelta(None, 3, [9], "z", tag=6)  # another request of the dead replica
    first = TextDelta("a", 0, [1], "x", tag=5)
    last = TextDelta(None, 2, [3], "w", Finish("stop", None, 1, 3).to_wire(), tag=5)
    routed = _routed(router, _entry(raced_ahead, other), _entry(first), _entry(last))
    assert routed == [("a", 0), ("a", 1), ("a", 2)]
    assert router.trim_point() is not None


def test_tags_nobody_waits_for_are_dropped_and_held_ones_are_bounded():
    tags = ReplyTags()
    assert tags.name(b"1-0", TextDelta(None, 1, [1], "x", tag=3)) == []  # nobody waits
    tags.expect("a")
    for i in range(MAX_UNNAMED + 10):
        tags.name(b"1-0", TextDelta(None, i, [1], "x", tag=9))
    assert len(tags._unnamed) == MAX_UNNAMED
    named = tags.name(b"2-0", TextDelta("a", 0, [1], "x", tag=9))
    assert len(named) == MAX_UNNAMED + 1 and {d.rid for _, d in named} == {"a"}


def test_a_forgotten_request_s_tag_no_longer_routes():
    router = ReplyRouter(REPLY)
    router.register("a")
    tag = router.tag("a")
    router.unregister("a")
    assert tag not in router.tags.rid_of
    router.register("a")  # the rid again, under a new tag: the old one names nothing
    assert router.tag("a") != tag
    assert _routed(router, _entry(TextDelta(None, 0, [1], "x", tag=tag))) == []
