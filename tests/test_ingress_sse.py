"""The SSE writer's encodings: a chunk built from its pre-encoded head is the same JSON as
the whole chunk encoded at once, with the same key order, for any fingerprint."""

from __future__ import annotations

import json

import pytest

from stages.ingress.api.sse import ChunkEncoder, encode_json


@pytest.mark.parametrize("extra", [{}, {"usage": None}])
@pytest.mark.parametrize("fingerprint", [None, "v1", 'w"eird,\u00e9'])
def test_a_chunk_from_its_encoded_head_is_the_chunk(extra, fingerprint):
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    choices = [{"index": 0, "delta": {"content": 'h\u00e9\n"i'}, "finish_reason": None}]
    chunks = ChunkEncoder(head, extra)
    whole = {**head, "system_fingerprint": fingerprint, "choices": choices, **extra}
    for _ in range(2):  # the second from the cached prefix
        encoded = chunks.encode(fingerprint, choices)
        assert encoded == encode_json(whole)
        assert json.loads(encoded) == whole


@pytest.mark.parametrize("extra", [{}, {"usage": None}])
@pytest.mark.parametrize("fingerprint", [None, "v1"])
def test_a_text_chunk_from_its_cached_encoding_is_the_chunk(extra, fingerprint):
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    chunks = ChunkEncoder(head, extra)

    def shape(text):
        return {"index": 1, "delta": {"content": text}, "logprobs": None, "finish_reason": None}

    for text in ['h\u00e9\n"i', "", "\x00text\x00", "\u2028 \\ \U0001f600", "plain"]:
        assert chunks.encode_text(fingerprint, 1, text, shape) == chunks.encode(
            fingerprint, [shape(text)]
        )
