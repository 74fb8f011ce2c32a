"""Deltas that count their tokens instead of listing them (a job's ``text_only``,
jobs/requests.py): what an OpenAI answer without logprobs asks for, since it shows text and
takes its usage from the Finish. Its streams and answers are the same as with ids; the ids
are what its replies no longer carry into Redis (issue 27)."""

from __future__ import annotations

import re

import msgpack
import pytest

from bus.actor import Inbound
from bus.reply_order import ReplyOrderer
from jobs.protocol import (
    ProtocolError,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TokenItem,
    decode,
    encode,
)
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

PIECES = [("Once", [11]), (" up", [12, 13]), (" on", [14]), (" a", [15, 16])]
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def _counted(rid: str, pieces=PIECES) -> list[TextDeltas]:
    """`deltas` of `pieces` as a detokenizer writes them for a text_only job: one bundle
    each, the ids replaced by their count."""
    out = []
    for delta in deltas(rid, pieces):
        delta.n, delta.ids = len(delta.ids), []
        out.append(TextDeltas([delta]))
    return out


# ---- the wire --------------------------------------------------------------------------------


def test_a_counted_delta_round_trips_in_a_bundle_and_keeps_its_ids_out():
    delta = TextDelta("r", 3, [], " up", n=2)
    wire = delta.fields_wire(narrow=True)
    assert "ids" not in wire and wire["n"] == 2
    (back,) = decode(encode(TextDeltas([delta])), TextDeltas).deltas
    assert (back.seq, back.ids, back.n, back.count, back.text) == (3, [], 2, 2, " up")
    assert TextDelta("r", 3, [7, 8], "x").count == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"rid": "r", "seq": 0, "n": -1},
        {"rid": "r", "seq": 0, "n": 2**31},
        {"rid": "r", "seq": 0, "n": "2"},
        {"rid": "r", "seq": 0, "n": 2, "ids": b"\x01\x00\x00\x00"},
        {"rid": "r", "seq": 0, "n": 2, "ids": b"\x01\x00\x00\x00", "weights_version": "v"},
        {"rid": "r", "seq": 0, "n": -3, "weights_version": "v"},
    ],
)
def test_a_malformed_count_is_refused(bad):
    with pytest.raises(ProtocolError, match="'n'"):
        decode(msgpack.packb({"kind": "delta", **bad}), TextDelta)


# ---- the detokenizer -------------------------------------------------------------------------


def _handled(*items: TokenItem) -> list[TextDelta]:
    stage = DetokenizerStage(BusConfig(), None)
    batch = decode(encode(TokenBatch("w", 1, list(items))), TokenBatch)  # as it comes
    out = []
    for output in stage.handle([Inbound(b"1-0", batch)]):
        message = getattr(output, "message", None)
        if isinstance(message, TextDeltas):
            out.extend(message.deltas)
        elif isinstance(message, TextDelta):
            out.append(message)
    return out


def test_the_detokenizer_counts_the_ids_of_a_text_only_job_and_lists_the_others():
    counted = TokenItem("a", "s", 0, [5, 6, 7], [], bundle=True, text_only=True)
    listed = TokenItem("b", "s", 0, [8], [], bundle=True)
    plain = TokenItem("c", "t", 0, [9, 9], [], text_only=True)  # no bundle: ids, as ever
    by_rid = {d.rid: d for d in _handled(counted, listed, plain)}
    assert (by_rid["a"].ids, by_rid["a"].n) == ([], 3)
    assert (by_rid["b"].ids, by_rid["b"].n) == ([8], None)
    assert (by_rid["c"].ids, by_rid["c"].n) == ([9, 9], None)


def test_a_token_batch_carries_text_only_once_for_the_items_that_share_it():
    items = [TokenItem(r, "s", 0, [1], [], bundle=True, text_only=True) for r in "abc"]
    items.append(TokenItem("d", "s", 0, [1], [], bundle=True))
    wire = TokenBatch("w", 1, items).to_wire()
    assert wire["text_only"] is True
    assert ["text_only" in item for item in wire["items"]] == [False] * 4
    back = decode(encode(TokenBatch("w", 1, items)), TokenBatch)
    assert [item.text_only for item in back.items] == [True, True, True, False]


def test_counted_deltas_are_put_in_order_and_their_copies_dropped():
    first, second, last = [bundle.deltas[0] for bundle in _counted("r", PIECES[:3])]
    orderer = ReplyOrderer()
    released = [d for m in (second, first, first, last, second) for d in orderer.push(m)]
    assert [(d.seq, d.count) for d in released] == [(0, 1), (1, 2), (3, 1)]
    assert orderer.done


# ---- the ingress -----------------------------------------------------------------------------


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url) as server:
        add_worker(redis_client, server.config)
        yield server


@pytest.mark.parametrize(
    "path, body, text_only",
    [
        ("/v1/chat/completions", CHAT, True),
        ("/v1/completions", {"prompt": "Hi"}, True),
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, None),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 2}, None),
        ("/generate", {"text": "Hi"}, None),
    ],
)
def test_openai_answers_without_logprobs_ask_for_counted_deltas(ingress, path, body, text_only):
    script = _Recording()
    with Upstream(ingress.config.redis_url, ingress.config, script):
        status, _ = ingress.post(path, {"model": MODEL, **body})
    assert status == 200
    assert [job.text_only for job in script.jobs] == [text_only]


class _Recording:
    def __init__(self) -> None:
        self.jobs = []

    def __call__(self, request):
        self.jobs.append(request)
        return deltas(request.rid, [("ok", [1])])


def _stream(ingress, script, resumable: bool) -> bytes:
    options = {"include_usage": True, "resumable": resumable}
    body = {"model": MODEL, "stream": True, "stream_options": options, "n": 2, **CHAT}
    with Upstream(ingress.config.redis_url, ingress.config, script):
        status, _, data = ingress.request("POST", "/v1/chat/completions", body)
    assert status == 200, data
    # Each request's own id and creation time aside.
    return re.sub(rb'"id":"[^"]*","object":"([^"]*)","created":\d+', rb"\1", data)


@pytest.mark.parametrize("resumable", [False, True])
def test_a_stream_of_counted_deltas_is_the_stream_of_listed_ones(ingress, resumable):
    """Text, usage and (for a resumable stream) the event ids' progress, all the same."""
    listed = _stream(ingress, lambda r: deltas(r.rid, PIECES), resumable)
    counted = _stream(ingress, lambda r: _counted(r.rid), resumable)
    if resumable:  # the event ids name each request: its progress must match
        listed, counted = (re.sub(rb"id: [^/\n]*/[^/\n]*/", b"id: ", s) for s in (listed, counted))
        assert b"id: " in counted
    assert counted == listed
    (completion,) = re.findall(rb'"completion_tokens":(\d+)', counted)
    assert int(completion) == 2 * sum(len(ids) for _, ids in PIECES)


def test_a_whole_answer_of_counted_deltas_is_the_answer_of_listed_ones(ingress):
    def answer(script):
        with Upstream(ingress.config.redis_url, ingress.config, script):
            status, body = ingress.post("/v1/chat/completions", {"model": MODEL, **CHAT})
        assert status == 200
        return body["choices"], body["usage"]

    assert answer(lambda r: _counted(r.rid)) == answer(lambda r: deltas(r.rid, PIECES))
