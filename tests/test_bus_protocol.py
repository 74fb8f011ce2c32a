"""The wire protocol: every message kind survives a round trip, token ids travel packed (int32
bytes, or uint16s where they fit: tests/test_wire_narrow_ids.py), and anything malformed is a
ProtocolError that says what is wrong."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest

from jobs.legacy_records import finish_as_list
from jobs.protocol import (
    ENTRY_FIELD,
    MESSAGE_TYPES,
    Abort,
    ErrorReply,
    Finish,
    GenerateRequest,
    Heartbeat,
    KvEvents,
    Message,
    ProgressEntry,
    ProtocolError,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TokenItem,
    TokenizedRequest,
    decode,
    encode,
    pack_ids,
    unpack_ids,
)
from jobs.wire import NARROW_IDS_EXT

ALL_KINDS = tuple(MESSAGE_TYPES.values())
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def _token_batch() -> TokenBatch:
    finished = TokenItem(
        rid="r1",
        reply_to="streamserve:reply:f1",
        start=3,
        ids=[101, 102],
        context=[7, 8, 9, 100],
        prompt_context=3,
        stop=["\n\n", "END"],
        skip_special_tokens=False,
        finish=Finish("stop", "END", prompt_tokens=12, completion_tokens=5, cached_tokens=4),
        logprobs=[-0.25, -1.5],
        top_logprobs=[[[101, -0.25], [5, -2.0]], [[102, -1.5], [6, -1.75]]],
    )
    running = TokenItem("r2", "streamserve:reply:f2", 0, [INT32_MAX], [1], 1)
    first = TokenItem(
        "r3", "streamserve:reply:f2", 0, [4], [2, 3], 2, prompt_ids=[2, 3],
        prompt_logprobs=[None, -0.5], prompt_top_logprobs=[None, [[3, -0.5], [9, -1.0]]],
    )  # fmt: skip
    return TokenBatch(worker_id="gpu0", step=42, items=[finished, running, first])


SAMPLES: list[Message] = [
    GenerateRequest(
        "g-text", "streamserve:reply:f1", prompt="Hello", sampling={"temperature": 0.5},
        created=1_700_000_000.25,
    ),
    GenerateRequest(
        "g-chat", "streamserve:reply:f1",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        sampling={"max_new_tokens": 8, "stop": ["x"]},
    ),
    GenerateRequest("g-ids", "streamserve:reply:f1", input_ids=[0, 1, INT32_MAX]),
    TokenizedRequest("t1", "streamserve:reply:f1", [5, 6, 7], {"seed": 3}, created=12.5),
    TokenizedRequest("t2", "streamserve:reply:f1", [5]),
    Abort("a1"),
    _token_batch(),
    TokenBatch("gpu1", 0, []),
    TextDelta(
        "d1", 4, [11, 12], "ab", Finish("length", None, 3, 6).to_wire(), [-0.5, -0.125],
        [[[11, -0.5]], [[12, -0.125]]], ["a", "b"],
    ),
    TextDelta("d2", 0, [11]),
    TextDelta("d3", 0, [], prompt_ids=[2, 3], prompt_text="ab", prompt_logprobs=[None, -0.5],
              prompt_top_logprobs=[None, [[3, -0.5]]], prompt_token_texts=["a", "b"],
              prompt_top_token_texts=[None, ["b"]]),  # fmt: skip
    ErrorReply("e1", 503, "no worker", "service_unavailable", "model", "no_worker"),
    ErrorReply("e2", 400, "bad"),
    TokenizedRequest("t3", "streamserve:reply:f1", [5], progress=[7, 8], bundle_replies=True),
    TextDeltas([TextDelta("d4", 0, [11], "a"), TextDelta("d5", 2, [12, 13], "bc")]),
    ProgressEntry("gpu0", {"t1": [0, pack_ids([1, 2])], "t2": [5, pack_ids([3])]}),
    KvEvents("gpu0", [1, 2**64 - 1], [7]),
    TokenizedRequest("t4", "streamserve:reply:f1", [5], route_reason="prefix", expected_cached=32),
    KvEvents("gpu1", [], snapshot=True),
    Heartbeat("gpu0", "streamserve:worker:gpu0", "smollm2", 2, 3, 4096, 8192, 17, 1234.5),
]  # fmt: skip


def _wire(message: Message, **changes: object) -> dict:
    """The message's wire map with fields replaced (a value of ... removes the field)."""
    data = message.to_wire()
    for name, value in changes.items():
        if value is ...:
            del data[name]
        else:
            data[name] = value
    return data


def _packed(data: object) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def test_samples_cover_every_message_kind():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: f"{m.KIND}-{getattr(m, 'rid', '')}")
def test_every_message_kind_survives_encode_then_decode(message):
    decoded = decode(encode(message), type(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_token_batch_round_trip_keeps_items_finish_and_logprobs():
    decoded = decode(encode(_token_batch()), TokenBatch)
    first, second, third = decoded.items
    assert isinstance(first, TokenItem) and isinstance(first.finish, Finish)
    assert first.finish.usage() == {
        "prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "cached_tokens": 4,
    }  # fmt: skip
    assert first.logprobs == [-0.25, -1.5]
    assert first.top_logprobs[1] == [[102, -1.5], [6, -1.75]]
    assert second.finish is None and second.logprobs is None and second.ids == [INT32_MAX]
    assert second.prompt_ids is None
    assert third.prompt_ids == [2, 3] and third.prompt_logprobs == [None, -0.5]
    assert third.prompt_top_logprobs == [None, [[3, -0.5], [9, -1.0]]]


def test_text_delta_finish_reads_back_as_finish():
    delta = decode(encode(SAMPLES[8]), TextDelta)
    assert delta.finish_info() == Finish("length", None, 3, 6, 0)
    assert decode(encode(TextDelta("d", 0, [1])), TextDelta).finish_info() is None


def test_decode_returns_whichever_accepted_kind_the_entry_holds():
    assert decode(encode(Abort("x")), TokenizedRequest, Abort) == Abort("x")
    job = TokenizedRequest("y", "r", [1])
    assert decode(encode(job), TokenizedRequest, Abort) == job


def test_float_fields_accept_integers_and_read_back_as_float():
    payload = _packed(_wire(SAMPLES[3], created=7))
    created = decode(payload, TokenizedRequest).created
    assert created == 7.0 and isinstance(created, float)


# ---- token ids on the wire -------------------------------------------------------------------


def test_pack_ids_writes_little_endian_int32():
    ids = [0, 1, -1, 258, INT32_MAX, INT32_MIN]
    assert pack_ids(ids) == struct.pack("<6i", *ids)
    assert unpack_ids(pack_ids(ids)) == ids
    assert pack_ids([]) == b"" and unpack_ids(b"") == []


def test_ids_travel_as_one_packed_field_not_a_list_of_ints():
    wire = msgpack.unpackb(encode(TokenizedRequest("r", "q", [1, 2, 70_000])), raw=False)
    assert wire["input_ids"] == struct.pack("<3i", 1, 2, 70_000)
    wire = msgpack.unpackb(encode(TokenizedRequest("r", "q", [1, 2, 3])), raw=False)
    assert wire["input_ids"] == msgpack.ExtType(NARROW_IDS_EXT, struct.pack("<3H", 1, 2, 3))


@pytest.mark.parametrize("token, width", [(7, 2), (65_535, 2), (123_456, 4), (2_000_000_000, 4)])
def test_each_id_adds_two_or_four_bytes_to_the_payload_whatever_its_digits(token, width):
    def size(n: int) -> int:
        return len(encode(TokenizedRequest("r", "q", [token] * n)))

    # 10..40 ids stay within msgpack's one-byte length header.
    assert [size(n + 1) - size(n) for n in (10, 20, 39)] == [width] * 3


def test_payload_size_does_not_depend_on_id_magnitude_within_a_width():
    assert len(encode(TokenizedRequest("r", "q", [1] * 50))) == len(
        encode(TokenizedRequest("r", "q", [65_535] * 50))
    )
    small = encode(TokenizedRequest("r", "q", [65_536] * 50))
    large = encode(TokenizedRequest("r", "q", [INT32_MAX] * 50))
    assert len(small) == len(large)


def test_unpack_ids_rejects_a_length_that_is_not_a_multiple_of_four():
    with pytest.raises(ProtocolError, match="7 bytes is not a multiple of 4"):
        unpack_ids(b"\x00" * 7)


# ---- malformed entries -----------------------------------------------------------------------

_TOK = TokenizedRequest("t", "reply", [1, 2], {})
_BEAT = SAMPLES[-1]
_GEN_BASE = {"kind": "generate", "rid": "g", "reply_to": "reply", "sampling": {}}


def _legacy_item(item: TokenItem) -> list:
    """The item as a worker before wire version 2 sent it: a positional list of 12."""
    finish = None if item.finish is None else finish_as_list(item.finish)
    prompt = None
    if item.prompt_ids is not None:
        prompt = [pack_ids(item.prompt_ids), item.prompt_logprobs, item.prompt_top_logprobs]
    return [
        item.rid, item.reply_to, item.start, pack_ids(item.ids), pack_ids(item.context),
        item.prompt_context, item.stop, item.skip_special_tokens, finish, item.logprobs,
        item.top_logprobs, prompt,
    ]  # fmt: skip


def _item_wire(**changes: object) -> list:
    item = _legacy_item(_token_batch().items[0])
    order = [
        "rid", "reply_to", "start", "ids", "context", "prompt_context", "stop",
        "skip_special_tokens", "finish", "logprobs", "top_logprobs",
    ]  # fmt: skip
    for name, value in changes.items():
        item[order.index(name)] = value
    return item


def _batch_with(item: object) -> bytes:
    return _packed({"kind": "tokens", "worker_id": "w", "step": 1, "items": [item]})


MALFORMED = [
    ("never-used-byte", b"\xc1", (TokenizedRequest,), r"not msgpack"),
    ("truncated", encode(_TOK)[:-3], (TokenizedRequest,), r"not msgpack"),
    ("trailing-bytes", encode(_TOK) + b"\x00", (TokenizedRequest,), r"not msgpack"),
    ("int-map-key", _packed({1: "x"}), (TokenizedRequest,), r"not msgpack"),
    ("bad-utf8", b"\xa2\xff\xfe", (TokenizedRequest,), r"not msgpack"),
    ("list", _packed([1, 2]), (TokenizedRequest,), r"must be a msgpack map, got list"),
    ("string", _packed("tokenized"), (TokenizedRequest,), r"must be a msgpack map, got str"),
    ("no-kind", _packed({"rid": "x"}), (TokenizedRequest,), r"unexpected message kind None"),
    ("unknown-kind", _packed({"kind": "bogus"}), ALL_KINDS,
     r"unexpected message kind 'bogus' \(this stream takes generate, "),
    ("int-kind", _packed({"kind": 3}), ALL_KINDS, r"unexpected message kind 3"),
    ("kind-not-accepted", encode(Abort("a")), (TokenizedRequest,),
     r"unexpected message kind 'abort' \(this stream takes tokenized\)"),
    ("missing-rid", _packed(_wire(_TOK, rid=...)), (TokenizedRequest,),
     r"field 'rid' is missing"),
    ("nil-rid", _packed(_wire(_TOK, rid=None)), (TokenizedRequest,), r"field 'rid' is missing"),
    ("missing-ids", _packed(_wire(_TOK, input_ids=...)), (TokenizedRequest,),
     r"field 'input_ids' is missing"),
    ("int-rid", _packed(_wire(_TOK, rid=5)), (TokenizedRequest,),
     r"field 'rid' must be str, got int"),
    ("list-sampling", _packed(_wire(_TOK, sampling=[])), (TokenizedRequest,),
     r"field 'sampling' must be map, got list"),
    ("ids-as-int-list", _packed(_wire(_TOK, input_ids=[1, 2])), (TokenizedRequest,),
     r"field 'input_ids' must be ids, got list"),
    ("ids-as-str", _packed(_wire(_TOK, input_ids="1 2")), (TokenizedRequest,),
     r"field 'input_ids' must be ids, got str"),
    ("ids-odd-length", _packed(_wire(_TOK, input_ids=b"\x01\x00\x00")), (TokenizedRequest,),
     r"3 bytes is not a multiple of 4"),
    ("bool-running", _packed(_wire(_BEAT, running=True)), (Heartbeat,),
     r"field 'running' must be int, got bool"),
    ("bool-step", _packed({"kind": "tokens", "worker_id": "w", "step": False, "items": []}),
     (TokenBatch,), r"field 'step' must be int, got bool"),
    ("bool-status", _packed(_wire(ErrorReply("e", 400, "m"), status=True)), (ErrorReply,),
     r"field 'status' must be int, got bool"),
    ("float-status", _packed(_wire(ErrorReply("e", 400, "m"), status=400.0)), (ErrorReply,),
     r"field 'status' must be int, got float"),
    ("str-time", _packed(_wire(_BEAT, time="now")), (Heartbeat,),
     r"field 'time' must be float, got str"),
    ("bool-time", _packed(_wire(_BEAT, time=True)), (Heartbeat,),
     r"field 'time' must be float, got bool"),
    ("nan-created", _packed(_wire(_TOK, created=float("nan"))), (TokenizedRequest,),
     r"field 'created' must be finite"),
    ("inf-time", _packed(_wire(_BEAT, time=float("inf"))), (Heartbeat,),
     r"field 'time' must be finite"),
    ("generate-none", _packed(_GEN_BASE), (GenerateRequest,),
     r"exactly one of prompt, messages, input_ids; got \[\]"),
    ("generate-two", _packed({**_GEN_BASE, "prompt": "p", "input_ids": pack_ids([1])}),
     (GenerateRequest,), r"exactly one of .*got \['prompt', 'input_ids'\]"),
    ("generate-three",
     _packed({**_GEN_BASE, "prompt": "p", "messages": [], "input_ids": pack_ids([1])}),
     (GenerateRequest,), r"got \['prompt', 'messages', 'input_ids'\]"),
    ("items-not-list", _packed({"kind": "tokens", "worker_id": "w", "step": 1, "items": {}}),
     (TokenBatch,), r"field 'items' must be list, got dict"),
    ("item-short", _batch_with(["r", "q", 0]), (TokenBatch,),
     r"token item must be a list of 11 or 12"),
    ("item-prompt-context-too-big", _batch_with(_item_wire(prompt_context=5)), (TokenBatch,),
     r"'prompt_context' exceeds the context"),
    ("item-prompt-context-negative", _batch_with(_item_wire(prompt_context=-1)), (TokenBatch,),
     r"'prompt_context' exceeds the context"),
    ("item-ids-odd", _batch_with(_item_wire(ids=b"\x01\x02")), (TokenBatch,),
     r"2 bytes is not a multiple of 4"),
    ("item-bool-start", _batch_with(_item_wire(start=True)), (TokenBatch,),
     r"field 'start' must be int, got bool"),
    ("item-stop-not-strings", _batch_with(_item_wire(stop=[1])), (TokenBatch,),
     r"field 'stop' must be a list of strings"),
    ("item-skip-not-bool", _batch_with(_item_wire(skip_special_tokens=1)), (TokenBatch,),
     r"field 'skip_special_tokens' must be bool, got int"),
    ("item-logprobs-map", _batch_with(_item_wire(logprobs={})), (TokenBatch,),
     r"field 'logprobs' must be a list"),
    ("item-finish-short", _batch_with(_item_wire(finish=["stop", None, 1])), (TokenBatch,),
     r"field 'finish' must be a list of 5, 7 or 8"),
    ("item-finish-bool-tokens", _batch_with(_item_wire(finish=["stop", None, True, 1, 0])),
     (TokenBatch,), r"field 'finish.prompt_tokens' must be int, got bool"),
    ("item-finish-matched-float", _batch_with(_item_wire(finish=["stop", 1.5, 1, 1, 0])),
     (TokenBatch,), r"field 'finish.matched' must be str, int or nil"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("payload", "accepted", "reason"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_entry_is_a_protocol_error_with_the_reason(payload, accepted, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(payload, *accepted)


def test_an_entry_without_the_message_field_is_a_protocol_error():
    with pytest.raises(ProtocolError, match=f"no {ENTRY_FIELD.decode()!r} field"):
        decode(None, TokenizedRequest)


@pytest.mark.parametrize(
    "forms", [{}, {"prompt": "p", "messages": []}, {"messages": [], "input_ids": [1]}]
)
def test_generate_request_needs_exactly_one_input_form_when_built_too(forms):
    with pytest.raises(ProtocolError, match="exactly one of prompt, messages, input_ids"):
        GenerateRequest("g", "reply", **forms)


def test_empty_input_ids_are_a_given_input_form():
    # An empty prompt is the tokenizer's 400 to give, not a protocol error.
    job = decode(encode(GenerateRequest("g", "reply", input_ids=[])), GenerateRequest)
    assert job.input_ids == [] and job.prompt is None


def test_text_delta_with_malformed_finish_is_rejected_by_decode():
    payload = _packed(_wire(TextDelta("d", 0, [1]), finish=[1, 2]))
    with pytest.raises(ProtocolError, match="finish"):
        decode(payload, TextDelta)


@pytest.mark.parametrize("field, value", [
    ("rid", 5), ("rid", ...), ("seq", "3"), ("seq", True), ("seq", ...), ("ids", [1, 2]),
    ("ids", b"\x01\x02\x03"), ("text", 7), ("text", b"bytes"),
])  # fmt: skip
def test_a_delta_with_a_wrong_common_field_names_it(field, value):
    wire = _wire(TextDelta("d", 0, [1], "hi"), **{field: value})  # ...: left out
    with pytest.raises(ProtocolError, match=field):
        decode(_packed(wire), TextDelta)


def test_a_delta_with_rarer_fields_or_unknown_ones_reads_back_whole():
    full = TextDelta("d", 4, [1, 2], "ab", logprobs=[-0.5, -1.0], token_texts=["a", "b"],
                     prompt_ids=[7, 8], prompt_text="hi")  # fmt: skip
    assert decode(encode(full), TextDelta) == full
    later = _wire(TextDelta("d", 0, [3], "c"), from_a_later_version=1)
    assert decode(_packed(later), TextDelta) == TextDelta("d", 0, [3], "c")


# ---- robustness ------------------------------------------------------------------------------

_ODD_VALUES = [
    None, True, False, 0, -1, 2**63, 1.5, float("nan"), "", "x", b"", b"\x01\x02\x03",
    [], [None], {}, {"k": 1}, [[1, -0.5]],
]  # fmt: skip


def _mutated(value: object, rng: random.Random) -> object:
    """`value` with one element somewhere deleted or replaced by an odd value."""
    if isinstance(value, (dict, list)) and value and rng.random() < 0.8:
        value = value.copy()
        key = rng.choice(list(value)) if isinstance(value, dict) else rng.randrange(len(value))
        if rng.random() < 0.25:
            del value[key]
        else:
            value[key] = _mutated(value[key], rng)
        return value
    return rng.choice(_ODD_VALUES)


def _fuzz_payload(rng: random.Random) -> bytes:
    message = rng.choice(SAMPLES)
    roll = rng.random()
    if roll < 0.2:
        return rng.randbytes(rng.randrange(64))
    if roll < 0.5:
        payload = bytearray(encode(message))
        for _ in range(rng.randint(1, 4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        cut = rng.randrange(len(payload) + 1) if rng.random() < 0.2 else len(payload)
        return bytes(payload[:cut])
    return _packed(_mutated(message.to_wire(), rng))


def test_decode_raises_only_protocol_errors_for_random_and_mutated_payloads():
    rng = random.Random(20240917)
    escaped, rejected, accepted = [], 0, 0
    for _ in range(600):
        payload = _fuzz_payload(rng)
        try:
            decoded = decode(payload, *ALL_KINDS)
        except ProtocolError:
            rejected += 1
        except Exception as exc:  # what must not happen: anything but ProtocolError
            escaped.append((payload, repr(exc)))
        else:
            assert isinstance(decoded, ALL_KINDS)
            accepted += 1
    assert escaped == []
    # The loop must reach both outcomes, or it exercises nothing.
    assert rejected > 100 and accepted > 10


def test_a_finish_carries_draft_counts_only_when_the_worker_speculated():
    plain = Finish("stop", 2, 10, 4, 3)
    assert len(plain.to_wire()) == 5  # what readers without speculation expect
    spec = Finish("length", None, 10, 40, 0, draft_tokens=36, accepted_draft_tokens=30)
    assert Finish.from_wire(spec.to_wire()) == spec
    assert spec.usage()["accepted_draft_tokens"] == 30
    assert "draft_tokens" not in plain.usage()


def test_a_finish_carries_the_queue_time_when_measured():
    timed = Finish("stop", 2, 10, 4, 3, queue_seconds=0.25)
    # Zero draft counts are left off the map (the list of version 1 keeps its positions).
    assert len(timed.to_wire()) == 6 and Finish.from_wire(timed.to_wire()) == timed
    assert len(finish_as_list(timed)) == 8
    assert Finish.from_wire(Finish("stop", 2, 10, 4, 3).to_wire()).queue_seconds is None
    with pytest.raises(ProtocolError, match="queue_seconds"):
        Finish.from_wire(["stop", 2, 10, 4, 3, 0, 0, "soon"])


def test_a_token_item_of_a_worker_before_prompt_logprobs_still_decodes():
    item = TokenItem("r", "q", 0, [5], [1], 1, reply_version=1)
    old = _legacy_item(item)[:11]  # what such a worker sends: no prompt element
    assert TokenItem.from_wire(old) == item
