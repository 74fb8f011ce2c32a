"""A request's plain deltas handed to its sink as they are read (bus/reply_router.py).

A bundled delta that is a text and a token count alone (``tag``, ``seq``, ``n``, ``text``:
`is_plain`) goes to its request's sink when it is the next in its order and nothing of
that request waits in the same read's messages; the sink's True takes it, its False leaves
it released as the TextDelta its map reads as. Everything else is routed as before, and a
bundle with one malformed delta is still dropped whole.
"""

from __future__ import annotations

import msgpack
import pytest

from bus.reply_router import ReplyRouter
from jobs.protocol import (
    ENTRY_FIELD,
    ErrorReply,
    ProtocolError,
    TextDelta,
    TextDeltas,
    decode,
    encode,
    is_plain,
)
from jobs.token_records import Finish

REPLY = "streamserve:reply:ingress-1"
FINISH = Finish("stop", None, 3, 9).to_wire()


def _plain(tag: int, seq: int, n: int, text: str | None = "x") -> TextDelta:
    delta = TextDelta(None, seq, [], text, tag=tag)
    delta.n = n
    return delta


def _bundle(*deltas: TextDelta) -> bytes:
    return encode(TextDeltas(list(deltas)))


def test_plain_maps_are_kept_as_maps_that_read_as_the_same_text_deltas():
    first = TextDelta("r", 0, [], "a", tag=3)  # names its rid: not plain
    first.n = 1
    deltas = [first, _plain(3, 1, 2, "bc"), _plain(3, 3, 1, None), _plain(3, 4, 1)]
    deltas[-1].finish = FINISH  # a finish: not plain
    payload = _bundle(*deltas)
    read = decode(payload, TextDeltas, plain=True).deltas
    assert [type(d) for d in read] == [TextDelta, dict, dict, TextDelta]
    assert read[1] == {"tag": 3, "seq": 1, "n": 2, "text": "bc"}
    whole = decode(payload, TextDeltas).deltas
    assert [TextDelta.from_wire(d) if type(d) is dict else d for d in read] == whole
    assert all(isinstance(d, TextDelta) for d in whole)  # without `plain`, as before


@pytest.mark.parametrize(
    "delta",
    [
        {"tag": 1, "seq": 1, "n": 0, "text": "x"},  # carries nothing
        {"tag": -1, "seq": 1, "n": 1, "text": "x"},
        {"tag": 1, "seq": 1, "n": 1, "text": b"x"},
        {"tag": 1, "seq": 1, "n": 1, "text": "x", "worker": "w"},
        {"tag": 1, "seq": True, "n": 1},
        {"seq": 1, "n": 1, "text": "x"},
    ],
)
def test_maps_that_are_not_plain_are_read_as_text_deltas(delta):
    assert not is_plain(delta)
    assert is_plain({"tag": 1, "seq": 1, "n": 1, "text": "x"}) and is_plain(
        {"tag": 0, "seq": 0, "n": 3}
    )


def test_a_bundle_with_a_malformed_delta_is_refused_whole():
    wire = {"kind": "deltas", "deltas": [{"tag": 1, "seq": 0, "n": 1, "text": "x"},
                                         {"tag": 1, "seq": 1, "n": "1"}]}  # fmt: skip
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(wire), TextDeltas, plain=True)


class Sink:
    def __init__(self, takes: bool = True) -> None:
        self.takes = takes
        self.seen: list[tuple[str | None, int]] = []

    def __call__(self, text: str | None, n: int) -> bool:
        self.seen.append((text, n))
        return self.takes


def _router(*rids: str) -> tuple[ReplyRouter, dict[str, int]]:
    router = ReplyRouter(REPLY)
    for rid in rids:
        router.register(rid)
    return router, {rid: router.tag(rid) for rid in rids}


def _route(router: ReplyRouter, *payloads: bytes) -> list[tuple[str, int, type]]:
    entries = [(f"{i + 1}-0".encode(), {ENTRY_FIELD: p}) for i, p in enumerate(payloads)]
    return [(rid, getattr(m, "seq", -1), type(m)) for rid, m in router.route(entries)]


def test_in_order_plain_deltas_go_to_the_sink_and_the_rest_are_released():
    router, tags = _router("a", "b")
    sink = Sink()
    router.set_sink("a", sink)
    first = TextDelta("a", 0, [], "x", tag=tags["a"])  # its rid's first: released (names it)
    first.n = 1
    routed = _route(
        router,
        _bundle(first, _plain(tags["a"], 1, 2, "yz"), _plain(tags["b"], 5, 1)),
        _bundle(_plain(tags["a"], 3, 1, "w")),
    )
    # The rest of a's in this read follow its first, released; b has no sink (and its
    # delta, ahead of b's first, is held).
    assert routed == [("a", 0, TextDelta), ("a", 1, TextDelta), ("a", 3, TextDelta)]
    assert sink.seen == []
    assert _route(router, _bundle(_plain(tags["a"], 4, 1, None))) == []  # the next read's
    assert sink.seen == [(None, 1)]
    end = _plain(tags["a"], 6, 1)
    end.finish = FINISH
    assert _route(router, _bundle(_plain(tags["a"], 5, 1), end)) == [("a", 6, TextDelta)]
    assert sink.seen == [(None, 1), ("x", 1)]
    assert "a" not in router.rids()  # finished: forgotten, its sink too
    assert router.trim_point() is not None


def test_a_delta_ahead_of_its_order_or_a_copy_is_released_in_order_not_sunk():
    router, tags = _router("a")
    router.set_sink("a", sink := Sink())
    router._orderers["a"].next_seq = 1  # its first delta was read already
    routed = _route(router, _bundle(_plain(tags["a"], 2, 1, "c"), _plain(tags["a"], 1, 1, "b")))
    assert sink.seen == [] and routed == [("a", 1, TextDelta), ("a", 2, TextDelta)]
    assert _route(router, _bundle(_plain(tags["a"], 1, 1, "b"))) == []  # a copy: dropped
    assert sink.seen == []
    assert _route(router, _bundle(_plain(tags["a"], 3, 1, "d"))) == [] and sink.seen == [("d", 1)]


def test_a_declined_delta_is_released_as_the_text_delta_it_stands_for():
    router, tags = _router("a")
    router.set_sink("a", Sink(takes=False))
    router._orderers["a"].next_seq = 1
    [(rid, released)] = router.route([(b"1-0", {ENTRY_FIELD: _bundle(_plain(tags["a"], 1, 2))})])
    expected = _plain(tags["a"], 1, 2)
    expected.rid = "a"
    assert (rid, released) == ("a", expected)


def test_without_a_sink_or_after_an_error_nothing_is_sunk():
    router, tags = _router("a", "b")
    router.set_sink("a", sink_a := Sink())
    router.set_sink("b", sink_b := Sink())
    router.set_sink("a", None)
    for rid in "ab":
        router._orderers[rid].next_seq = 1
    error = encode(ErrorReply("b", 500, "worker lost"))
    routed = _route(
        router, _bundle(_plain(tags["a"], 1, 1)), error, _bundle(_plain(tags["b"], 1, 1))
    )
    assert routed == [("a", 1, TextDelta), ("b", -1, ErrorReply)]
    assert sink_a.seen == sink_b.seen == []
    router.set_sink("nobody", Sink())  # not registered: no sink kept
    assert "nobody" not in router._sinks
