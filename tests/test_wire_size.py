"""What keeps the bus's entries small, read back exactly.

A token batch writes the reply stream most of its items share once (jobs/protocol.py's
TokenBatch), and an item leaves off a zero ``prompt_context``. The bulkiest entries travel
deflated (jobs/wire.py): a token batch, a progress log entry and a bundle of deltas past
1 KiB are written zlib-deflated and read back equal; small ones and every other kind stay
plain msgpack; a deflated payload is refused on a stream whose kinds are never deflated,
and one that is not whole zlib data, or inflates past the bound, is a ProtocolError (a dead
letter), never an exception that ends a stage."""

from __future__ import annotations

import zlib

import msgpack
import pytest

import jobs.wire
from jobs.progress import ProgressEntry
from jobs.protocol import TextDelta, TextDeltas, TokenBatch, TokenizedRequest, decode, encode
from jobs.token_records import Finish, TokenItem
from jobs.wire import COMPRESS_FROM_BYTES, DEFLATED_MARK, ProtocolError

REPLY = "streamserve:reply:ingress-vm-1-abcdef"


def _batch(items: int) -> TokenBatch:
    return TokenBatch("w-1", 7, [
        TokenItem(f"chatcmpl-{i:032x}-0", REPLY, 60, [i, 2, 3, 4, 5], [9] * 8, 0, bundle=True)
        for i in range(items)
    ])  # fmt: skip


def test_a_batch_writes_the_reply_stream_most_items_share_once():
    other = "streamserve:reply:direct-client"
    items = [TokenItem(f"r{i}", REPLY, 60, [i], [9, 9], 0, bundle=True) for i in range(3)]
    items += [
        TokenItem("own", other, 0, [7], [1, 2], 2),  # a direct job: no bundle
        TokenItem("unbundled", REPLY, 3, [8], [5], 0),
    ]  # same stream, its own flag
    batch = TokenBatch("w-1", 7, items)
    wire = batch.to_wire()
    assert (wire["reply_to"], wire["bundle"]) == (REPLY, True)
    assert [item.get("reply_to") for item in wire["items"]] == [None, None, None, other, REPLY]
    assert "bundle" not in wire["items"][0] and "prompt_context" not in wire["items"][0]
    assert wire["items"][3]["prompt_context"] == 2
    assert decode(encode(batch), TokenBatch).items == items


def test_a_lone_item_keeps_its_reply_stream():
    wire = _batch(1).to_wire()
    assert "reply_to" not in wire and wire["items"][0]["reply_to"] == REPLY
    assert decode(encode(_batch(1)), TokenBatch).items == _batch(1).items


@pytest.mark.parametrize("shared", [{"reply_to": 5}, {"reply_to": REPLY, "bundle": "yes"}])
def test_a_malformed_shared_reply_stream_is_a_protocol_error(shared):
    wire = {**_batch(2).to_wire(), **shared}
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(wire), TokenBatch)


def test_a_large_token_batch_is_deflated_and_reads_back_equal():
    batch = _batch(64)
    payload = encode(batch)
    plain = msgpack.packb(batch.to_wire(), use_bin_type=True)
    assert payload[:1] == DEFLATED_MARK
    assert len(payload) < len(plain) / 2  # repeated names and prefixes deflate away
    assert decode(payload, TokenBatch) == decode(plain, TokenBatch)


def test_small_entries_and_jobs_stay_plain_msgpack():
    small = encode(_batch(1))
    assert len(small) < COMPRESS_FROM_BYTES and small[:1] != DEFLATED_MARK
    job = TokenizedRequest("r", REPLY, list(range(5000)))  # large, but a job: never deflated
    assert encode(job)[:1] != DEFLATED_MARK
    assert decode(encode(job), TokenizedRequest).input_ids == list(range(5000))


def test_progress_entries_and_delta_bundles_deflate_too():
    segments = {f"chatcmpl-{i:032x}-0": ProgressEntry.segment(60, [i, 2, 3]) for i in range(64)}
    progress = encode(ProgressEntry("w-1", segments))
    assert progress[:1] == DEFLATED_MARK
    assert list(decode(progress, ProgressEntry).spans())[3] == (f"chatcmpl-{3:032x}-0", 60,
                                                                 [3, 2, 3])  # fmt: skip
    finish = Finish("stop", None, 5, 6).to_wire()
    deltas = [TextDelta(f"chatcmpl-{i:032x}-0", 60, [1, 2], " a word", finish if i == 0 else None)
              for i in range(64)]  # fmt: skip
    bundle = encode(TextDeltas(deltas))
    assert bundle[:1] == DEFLATED_MARK
    read = decode(bundle, TextDelta, TextDeltas)
    assert read.deltas == deltas and read.deltas[0].finish_info().reason == "stop"


def test_a_deflated_payload_on_a_job_stream_is_refused_without_inflating():
    payload = zlib.compress(encode(TokenizedRequest("r", REPLY, [1, 2, 3])))
    with pytest.raises(ProtocolError, match="deflated"):
        decode(payload, TokenizedRequest)


@pytest.mark.parametrize("payload", [
    DEFLATED_MARK + b"\x01 not zlib at all",  # a bad header
    zlib.compress(msgpack.packb({"kind": "tokens"}))[:-3],  # cut short
    zlib.compress(b"\xc1 not msgpack"),  # inflates to what is not msgpack
    zlib.compress(msgpack.packb([1, 2])),  # inflates to what is not a map
])  # fmt: skip
def test_a_broken_deflated_payload_is_a_protocol_error(payload):
    with pytest.raises(ProtocolError):
        decode(payload, TokenBatch)


def test_a_payload_that_inflates_past_the_bound_is_refused(monkeypatch):
    monkeypatch.setattr(jobs.wire, "MAX_INFLATED_BYTES", 2**20)
    bomb = zlib.compress(bytes(2**22), 9)  # 4 MiB of zeros in ~4 KiB
    with pytest.raises(ProtocolError, match="inflates past"):
        decode(bomb, TokenBatch)
