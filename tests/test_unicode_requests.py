"""Text that is not Unicode, from a client, is that request's error, never a 500.

JSON may escape a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, not a character, and
no encoder downstream takes it. Each of these failed before jobs/unicode_text.py: a lone
surrogate anywhere in a body was a 500 on every generating endpoint (msgpack refused the
job), a batch line nested past the decoder's depth raised out of the input file's parse,
and an Authorization header of bytes that are not UTF-8 was a 500 where keys are set.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from batch_store.input_file import parse_input
from jobs.unicode_text import NotUnicode, check_unicode
from stages.ingress.api.tool_call_parser import ToolCallParser
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

KEY = "key-one"
CHAT = "/v1/chat/completions"


def _checked(text: str) -> None:
    check_unicode(json.loads(text), text)


def test_a_lone_surrogate_is_named_where_it_is():
    with pytest.raises(NotUnicode, match=r"messages\[1\]\.content .* \\ud800"):
        _checked('{"messages": [{"content": "ok"}, {"content": "a\\ud800"}]}')
    with pytest.raises(NotUnicode, match=r"^stop\[0\] .* \\udc00"):
        _checked('{"stop": ["\\udc00x"]}')  # a low half alone
    with pytest.raises(NotUnicode, match=r"^metadata is not"):
        _checked('{"metadata": {"\\udbff": "key, not value"}}')
    with pytest.raises(NotUnicode, match=r"^the value is not"):
        _checked('"\\ud83d"')


def test_a_surrogate_pair_and_an_escaped_backslash_pass():
    _checked('{"prompt": "\\ud83d\\ude00", "p": "\\\\ud800", "s": "\\u00e9"}')
    _checked('{"prompt": "no escape at all \u00e9"}')
    nested = "[" * 900 + '"\\ud83d\\ude00"' + "]" * 900  # walked without recursion
    _checked(nested)


def test_a_batch_line_not_unicode_or_too_deep_is_that_lines_error():
    lines = [
        {"custom_id": "ok", "body": {"messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "SURROGATE", "body": {"messages": []}},
        {"custom_id": "body", "body": {"messages": [{"role": "user", "content": "LONE"}]}},
    ]
    text = "\n".join(json.dumps({"method": "POST", "url": CHAT, **line}) for line in lines)
    text = text.replace("SURROGATE", "\\ud800").replace("LONE", "\\udfff")
    text += '\n{"custom_id": "deep", "url": "' + CHAT + '", "body": ' + "[" * 50_000
    text += "]" * 50_000 + "}"
    good, bad = parse_input(text.encode(), CHAT, 10, 1 << 20)
    assert [line.custom_id for line in good] == ["ok"]
    assert [(error.line, error.code) for error in bad] == [(n, "invalid_json") for n in (2, 3, 4)]
    assert "lone surrogate" in bad[0].message and "body.messages[0].content" in bad[1].message
    assert "recursion" in bad[2].message


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "get_time", "arguments": {"zone": "\\ud800"}}',
        '{"name": "get_time", "arguments": "{\\"zone\\": \\"\\\\udc00\\"}"}',
        '{"name": "get_time", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}",
    ],
)
def test_a_models_call_no_reply_could_encode_is_content_not_a_call(body):
    parser = ToolCallParser({"get_time"}, "x0")
    content, calls = parser.feed(f"<tool_call>\n{body}\n</tool_call>", final=True)
    assert calls == [] and body in content
    content.encode("utf-8")  # what goes out can be sent


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url, api_keys=(KEY,)) as server:
        add_worker(redis_client, server.config)
        script = lambda r: deltas(r.rid, [("Hi", [1])])  # noqa: E731
        with Upstream(redis_url, server.config, script):
            yield server


def _post(ingress, path: str, data: bytes, headers: dict[str, str] | None = None):
    request = urllib.request.Request(ingress.url + path, data=data, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {}),
    })  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


LONE = "\\ud800"  # as it stands in the JSON text
REQUESTS = [
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONE}]}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": LONE}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": LONE, "stream": True}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "user": LONE}, "user"),
    ("/v1/responses", {"model": MODEL, "input": LONE}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "metadata": {"a": LONE}}, "metadata"),
    ("/v1/embeddings", {"model": MODEL, "input": LONE}, "input"),
    ("/generate", {"text": LONE, "sampling_params": {"max_new_tokens": 1}}, "text"),
]


@pytest.mark.parametrize(("path", "body", "param"), REQUESTS)
def test_a_lone_surrogate_in_a_body_is_a_400_naming_its_field(ingress, path, body, param):
    data = json.dumps(body).replace("\\\\ud800", "\\ud800").encode()
    assert b"\\ud800" in data and b"\\\\ud800" not in data
    status, reply = _post(ingress, path, data)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert "lone surrogate \\ud800" in reply["error"]["message"]


def test_surrogate_bytes_are_not_json_and_a_pair_is_an_emoji(ingress):
    raw = b'{"model": "%s", "prompt": "a\xed\xa0\x80"}' % MODEL.encode()
    status, reply = _post(ingress, "/v1/completions", raw)
    assert status == 400 and reply["error"]["code"] == "invalid_json"
    pair = b'{"model": "%s", "prompt": "\\ud83d\\ude00", "max_tokens": 1}' % MODEL.encode()
    status, reply = _post(ingress, "/v1/completions", pair)
    assert status == 200 and reply["choices"][0]["text"] == "Hi"


def test_a_tool_calls_arguments_too_deep_or_not_unicode_are_a_400(ingress):
    for arguments in ("[" * 50_000 + "]" * 50_000, '{"a": "\\ud800"}'):
        call = {"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": arguments}}  # fmt: skip
        messages = [{"role": "user", "content": "x"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        status, reply = _post(ingress, CHAT, body)
        assert status == 400, reply
        assert "arguments is not JSON" in reply["error"]["message"]


def test_a_key_of_bytes_that_are_not_utf8_is_a_wrong_key(ingress):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    for key in ("\xff\xfe", KEY + "\xff"):  # sent as those bytes (latin-1)
        status, reply = _post(ingress, "/v1/completions", body, {"Authorization": f"Bearer {key}"})
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"


def test_an_upload_whose_file_name_is_not_utf8_is_a_400(ingress):
    line = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": {}}).encode()
    form = (b'--b0\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b0\r\nContent-Disposition: form-data; name="file"; filename="a\xff.jsonl"\r\n\r\n'
            + line + b"\r\n--b0--\r\n")  # fmt: skip
    status, reply = _post(ingress, "/v1/files", form,
                          {"Content-Type": "multipart/form-data; boundary=b0"})  # fmt: skip
    assert status == 400 and reply["error"]["param"] == "file", reply
    assert "name is not valid UTF-8" in reply["error"]["message"]
