"""Token ids in half the bytes where they fit (jobs/wire.py's `pack_ids_narrow`).

Every field of ids this project's own stages read (a job's prompt and progress, a token item's
ids, context and prompt, a progress segment, the ids of a bundle of deltas) is written as a
msgpack extension of uint16s when every id fits in 16 bits, else as int32 bytes, and reads
back equal either way. Entries written before, with int32 bytes, read as they did; a plain
TextDelta (a reply stream a program reads itself) keeps int32. A malformed extension (another
type, an odd length) is a ProtocolError naming the field: a dead letter, never a crash.
"""

from __future__ import annotations

import struct

import msgpack
import pytest

from jobs.progress import ProgressEntry, rebuild
from jobs.protocol import (
    GenerateRequest,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TokenizedRequest,
    decode,
    encode,
    pack_ids,
    pack_ids_narrow,
    unpack_ids,
)
from jobs.token_records import Finish, TokenItem
from jobs.wire import NARROW_IDS_EXT, ProtocolError

REPLY = "streamserve:reply:ingress-1"
NARROW = [0, 1, 258, 49_151, 65_535]
WIDE = [0, 1, 65_536, 128_255]


def _unpacked(payload: bytes) -> dict:
    return msgpack.unpackb(payload, raw=False)


def test_ids_that_fit_in_16_bits_pack_as_a_uint16_extension():
    packed = pack_ids_narrow(NARROW)
    assert packed == msgpack.ExtType(NARROW_IDS_EXT, struct.pack("<5H", *NARROW))
    assert unpack_ids(packed) == NARROW


@pytest.mark.parametrize("ids", [WIDE, [5, -1]])
def test_one_id_past_16_bits_or_below_zero_keeps_the_field_int32(ids):
    assert pack_ids_narrow(ids) == pack_ids(ids)
    assert unpack_ids(pack_ids_narrow(ids)) == ids


def test_no_ids_pack_as_empty_bytes():
    assert pack_ids_narrow([]) == b"" and unpack_ids(b"") == []


def test_a_narrow_field_is_half_the_bytes_of_int32():
    ids = list(range(1000, 1200))
    wide = len(msgpack.packb(pack_ids(ids)))
    narrow = len(msgpack.packb(pack_ids_narrow(ids), use_bin_type=True))
    assert (wide, narrow) == (3 + 4 * len(ids), 4 + 2 * len(ids))  # headers: bin16, ext16


@pytest.mark.parametrize("ids", [NARROW, WIDE])
def test_jobs_read_back_their_prompt_and_progress_in_either_width(ids):
    job = TokenizedRequest("r", REPLY, ids, {"max_new_tokens": 4}, progress=ids[::-1])
    assert decode(encode(job), TokenizedRequest) == job
    generate = GenerateRequest("g", REPLY, input_ids=ids)
    assert decode(encode(generate), GenerateRequest) == generate


@pytest.mark.parametrize("ids", [NARROW, WIDE])
def test_token_items_read_back_their_ids_context_and_prompt_in_either_width(ids):
    items = [
        TokenItem("a", REPLY, 0, ids, ids[:3], 3, prompt_ids=ids, prompt_logprobs=[None] * 5),
        TokenItem("b", REPLY, 9, [7], ids, finish=Finish("stop", 7, 5, 10)),
    ]
    wire = _unpacked(encode(TokenBatch("w", 1, items)))
    narrow = ids is NARROW
    assert isinstance(wire["items"][0]["ids"], msgpack.ExtType) == narrow
    assert decode(encode(TokenBatch("w", 1, items)), TokenBatch).items == items


@pytest.mark.parametrize("ids", [NARROW, WIDE])
def test_progress_segments_rebuild_in_either_width(ids):
    entry = ProgressEntry("w", {"r": ProgressEntry.segment(0, ids)})
    read = decode(encode(entry), ProgressEntry)
    assert rebuild([read], {"r": []}) == {"r": ids}


def test_a_bundle_of_deltas_carries_narrow_ids_and_a_plain_delta_keeps_int32():
    delta = TextDelta("r", 0, NARROW, "text", prompt_ids=NARROW)
    bundle = _unpacked(encode(TextDeltas([delta])))["deltas"][0]
    assert isinstance(bundle["ids"], msgpack.ExtType)
    assert isinstance(bundle["prompt_ids"], msgpack.ExtType)
    assert decode(encode(TextDeltas([delta])), TextDeltas).deltas == [delta]
    plain = _unpacked(encode(delta))
    assert plain["ids"] == pack_ids(NARROW) and plain["prompt_ids"] == pack_ids(NARROW)


def test_entries_written_with_int32_ids_still_read():
    """What a direct client, an older worker or detokenizer wrote before narrow ids."""
    old_job = {"kind": "tokenized", "rid": "r", "reply_to": REPLY, "v": 2, "sampling": {},
               "input_ids": pack_ids(NARROW), "progress": pack_ids([4])}  # fmt: skip
    assert decode(msgpack.packb(old_job), TokenizedRequest).input_ids == NARROW
    old_batch = {"kind": "tokens", "worker_id": "w", "step": 1, "v": 2, "items": [
        {"rid": "r", "reply_to": REPLY, "start": 0, "ids": pack_ids(NARROW),
         "context": pack_ids([1, 2])}]}  # fmt: skip
    assert decode(msgpack.packb(old_batch), TokenBatch).items[0].ids == NARROW
    old_progress = {"kind": "progress", "worker_id": "w", "segments": {"r": [0, pack_ids([3])]}}
    assert rebuild([decode(msgpack.packb(old_progress), ProgressEntry)], {"r": []}) == {"r": [3]}
    old_deltas = {"kind": "deltas", "deltas": [{"rid": "r", "seq": 0, "ids": pack_ids(NARROW)}]}
    assert decode(msgpack.packb(old_deltas), TextDeltas).deltas[0].ids == NARROW


_OTHER_EXT = msgpack.ExtType(NARROW_IDS_EXT + 1, b"\x01\x00")
_ODD = msgpack.ExtType(NARROW_IDS_EXT, b"\x01\x00\x02")


@pytest.mark.parametrize("bad", [_OTHER_EXT, _ODD], ids=["other-type", "odd-length"])
@pytest.mark.parametrize(
    "kind, entry",
    [
        ("tokenized", lambda bad: {"kind": "tokenized", "rid": "r", "reply_to": REPLY,
                                   "sampling": {}, "input_ids": bad}),
        ("tokenized", lambda bad: {"kind": "tokenized", "rid": "r", "reply_to": REPLY,
                                   "sampling": {}, "input_ids": b"", "progress": bad}),
        ("generate", lambda bad: {"kind": "generate", "rid": "r", "reply_to": REPLY,
                                  "input_ids": bad}),
        ("tokens", lambda bad: {"kind": "tokens", "worker_id": "w", "step": 1, "items": [
            {"rid": "r", "reply_to": REPLY, "start": 0, "ids": b"", "context": bad}]}),
        ("deltas", lambda bad: {"kind": "deltas", "deltas": [
            {"rid": "r", "seq": 0, "ids": bad, "text": "x"}]}),
    ],
)  # fmt: skip
def test_a_malformed_narrow_field_is_a_protocol_error(bad, kind, entry):
    accepted = {"tokenized": TokenizedRequest, "generate": GenerateRequest,
                "tokens": TokenBatch, "deltas": TextDeltas}[kind]  # fmt: skip
    with pytest.raises(ProtocolError, match="packed token ids: .*(extension type 3|3 bytes)"):
        decode(msgpack.packb(entry(bad)), accepted)


def test_a_progress_entry_with_a_malformed_narrow_segment_is_skipped_on_rebuild():
    good = ProgressEntry("w", {"r": ProgressEntry.segment(0, [1, 2])})
    bad = decode(msgpack.packb({"kind": "progress", "worker_id": "w",
                                "segments": {"r": [2, _ODD]}}), ProgressEntry)  # fmt: skip
    assert rebuild([good, bad], {"r": []}) == {"r": [1, 2]}
