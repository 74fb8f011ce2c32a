"""Resuming a stream with Last-Event-ID after its ingress died: the live ingress replays the
dead one's reply stream and sends exactly the events the client missed. Only streams whose
client asks for event ids carry them (an opt-in header, stream_options.resumable, or an
EventSource's Accept); the others are OpenAI's lone data lines.

A dead replica is what it leaves in Redis: the request's key, and replies on its reply
stream, with no liveness key.
"""

from __future__ import annotations

import json

import pytest

from jobs.protocol import ENTRY_FIELD, encode
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas, post_raw

DEAD = "ingress-deadhost-1-abcdef"
PIECES = [("Once", [1]), (" upon", [2, 3]), (" a", [4]), (" time", [5])]


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url) as server:
        add_worker(redis_client, server.config)
        yield server


def _left_by_a_dead_ingress(client, config, request_id: str, choices: int = 1) -> None:
    client.set(config.request_key(request_id), choices)
    for index in range(choices):
        for delta in deltas(f"{request_id}-{index}", PIECES):
            client.xadd(config.reply_stream(DEAD), {ENTRY_FIELD: encode(delta)})


def _events(data: bytes) -> list[tuple[str | None, str]]:
    out = []
    for event in data.decode().split("\n\n"):
        if not event:
            continue
        lines = dict(line.split(": ", 1) for line in event.split("\n"))
        out.append((lines.get("id"), lines["data"]))
    return out


def _resume(ingress, path: str, body: dict, last_event_id: str):
    return post_raw(ingress.url + path, body, {"Last-Event-ID": last_event_id})


COMPLETION = {"model": MODEL, "prompt": "Tell me", "stream": True}
RESUMABLE = {"X-Resumable-Stream": "true"}


@pytest.mark.parametrize(
    "path, body, headers, with_ids",
    [
        ("/v1/completions", COMPLETION, {}, False),
        ("/v1/completions", COMPLETION, {"Accept": "application/json"}, False),  # openai's
        ("/v1/completions", COMPLETION, {"Accept": "*/*"}, False),  # aiohttp's, vllm bench's
        ("/v1/completions", COMPLETION, RESUMABLE, True),
        ("/v1/completions", COMPLETION, {"Accept": "text/event-stream"}, True),  # EventSource
        ("/v1/completions", COMPLETION, {"Accept": "text/event-stream",
                                         "X-Resumable-Stream": "false"}, False),  # fmt: skip
        ("/v1/completions", {**COMPLETION, "stream_options": {"resumable": True}}, {}, True),
        ("/v1/completions", {**COMPLETION, "stream_options": {"resumable": False}}, RESUMABLE,
         False),  # fmt: skip
        ("/generate", {"text": "Hi", "stream": True}, {}, False),
        ("/generate", {"text": "Hi", "stream": True}, RESUMABLE, True),
    ],
    ids=["default", "openai-client", "any", "header", "event-source", "header-false",
         "stream-options", "stream-options-false", "native", "native-header"],
)  # fmt: skip
def test_a_stream_carries_event_ids_only_when_its_client_asks(
    ingress, redis_url, path, body, headers, with_ids
):
    with Upstream(redis_url, ingress.config, lambda request: deltas(request.rid, PIECES)):
        status, data = post_raw(ingress.url + path, body, headers)
    assert status == 200
    events = _events(data)
    assert events[-1] == (None, "[DONE]") and len(events) == len(PIECES) + 1
    ids = [event_id for event_id, _ in events[:-1]]
    if with_ids:
        assert all(i is not None and i.endswith(f"/{ingress.state.frontend_id}/" + p)
                   for i, p in zip(ids, ["1", "3", "4", "-"], strict=True)), ids  # fmt: skip
    else:
        assert ids == [None] * len(PIECES)
        assert not data.startswith(b"id:") and b"\nid:" not in data


def test_a_resumed_completion_gets_exactly_the_events_after_the_last_one(ingress, redis_client):
    _left_by_a_dead_ingress(redis_client, ingress.config, "cmpl-r1")
    status, data = _resume(ingress, "/v1/completions", COMPLETION, f"cmpl-r1/{DEAD}/3")
    assert status == 200
    events = _events(data)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(payload) for _, payload in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " a time"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["id"] == "cmpl-r1" for c in chunks)
    assert [i for i, _ in events[:-1]] == [f"cmpl-r1/{DEAD}/4", f"cmpl-r1/{DEAD}/-"]
    # The replayed stream is left for a later resume: this replica may die too.
    assert redis_client.xlen(ingress.config.reply_stream(DEAD)) == len(PIECES)


def test_a_resumed_chat_with_two_choices_continues_each_where_it_stopped(ingress, redis_client):
    _left_by_a_dead_ingress(redis_client, ingress.config, "chatcmpl-r2", choices=2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    # Choice 0 had finished, choice 1 had " upon" (3 tokens) when the stream broke.
    status, data = _resume(ingress, "/v1/chat/completions", body, f"chatcmpl-r2/{DEAD}/-.3")
    assert status == 200
    chunks = [json.loads(payload) for _, payload in _events(data)[:-1]]
    content = [c for c in chunks if c["choices"]]
    assert {c["choices"][0]["index"] for c in content} == {1}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == " a time"
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * 5  # usage covers whole choices


def test_a_resumed_native_stream_continues_after_its_last_event(ingress, redis_client):
    _left_by_a_dead_ingress(redis_client, ingress.config, "n1")
    body = {"text": "Hi", "stream": True}
    status, data = _resume(ingress, "/generate", body, f"n1/{DEAD}/1")
    assert status == 200
    parsed = [json.loads(payload) for _, payload in _events(data)[:-1]]
    assert sum((p["output_ids"] for p in parsed), []) == [2, 3, 4, 5]


@pytest.mark.parametrize(
    "last_event_id, status, code",
    [
        ("garbage", 400, "invalid_value"),
        (f"cmpl-r1/{DEAD}/1.1", 400, "invalid_value"),  # two choices; the body makes one
        (f"cmpl-gone/{DEAD}/1", 404, "request_not_found"),
    ],
)
def test_a_resume_that_cannot_be_served_says_why(
    ingress, redis_client, last_event_id, status, code
):
    _left_by_a_dead_ingress(redis_client, ingress.config, "cmpl-r1")
    answer_status, data = _resume(ingress, "/v1/completions", COMPLETION, last_event_id)
    assert (answer_status, json.loads(data)["error"]["code"]) == (status, code)


def test_a_stream_its_live_ingress_still_serves_is_not_resumed_elsewhere(ingress, redis_client):
    _left_by_a_dead_ingress(redis_client, ingress.config, "cmpl-r1")
    redis_client.set(ingress.config.frontend_key(DEAD), 1)  # not dead after all
    status, data = _resume(ingress, "/v1/completions", COMPLETION, f"cmpl-r1/{DEAD}/1")
    assert (status, json.loads(data)["error"]["code"]) == (409, "stream_in_progress")


def _stream_completion(port: int, headers: dict[str, str]):
    """A streamed completion on the ingress at `port`, its response open to read by line."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request("POST", "/v1/completions", json.dumps(COMPLETION),
                       {"Content-Type": "application/json", **headers})  # fmt: skip
    return connection.getresponse()


def test_a_stream_cut_by_sigterm_is_left_running_and_resumes_on_another_replica(
    redis_client, redis_url
):
    first = RunningIngress(redis_url)
    with RunningIngress(redis_url) as second, first:
        add_worker(redis_client, first.config)
        config = first.config
        head = lambda request: deltas(request.rid, PIECES)[:2]  # noqa: E731 (still running)
        with Upstream(redis_url, config, head) as up:
            response = _stream_completion(first.port, RESUMABLE)
            last_id = None
            for _ in range(2):
                last_id = response.readline().decode().removeprefix("id: ").strip()
                response.readline(), response.readline()  # data, blank line
            first.__exit__(None, None, None)  # SIGTERM: the stream is cut
            [request] = up.requests
        stream = config.reply_stream(first.state.frontend_id)
        assert not redis_client.exists(config.abort_key(request.rid))  # not aborted
        assert redis_client.exists(stream)  # its history kept
        assert not redis_client.exists(config.frontend_key(first.state.frontend_id))
        for delta in deltas(request.rid, PIECES)[2:]:  # the request goes on meanwhile
            redis_client.xadd(stream, {ENTRY_FIELD: encode(delta)})
        status, data = _resume(second, "/v1/completions", COMPLETION, last_id)
    assert status == 200
    chunks = [json.loads(payload) for _, payload in _events(data)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " a time"


def test_a_stream_without_ids_cut_by_sigterm_is_aborted(redis_client, redis_url):
    """Its client cannot resume it, so nothing is left running for nobody."""
    first = RunningIngress(redis_url)
    with first:
        add_worker(redis_client, first.config)
        config = first.config
        head = lambda request: deltas(request.rid, PIECES)[:2]  # noqa: E731 (still running)
        with Upstream(redis_url, config, head) as up:
            response = _stream_completion(first.port, {})
            assert response.readline().startswith(b"data: {")
            first.__exit__(None, None, None)  # SIGTERM: the stream is cut
            [request] = up.requests
    assert redis_client.exists(config.abort_key(request.rid))
