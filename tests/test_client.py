"""The direct Redis client, sync and async, against the real Redis with a scripted upstream."""

from __future__ import annotations

import asyncio

import pytest

from bus.client import AsyncClient, Client, RequestError
from jobs.protocol import ErrorReply, GenerateRequest, TextDelta
from runtime.config import BusConfig
from tests.ingress_harness import Upstream, deltas, embedding_delta

PIECES = [("Hel", [10, 11]), ("lo", [12]), ("!", [13])]


def scrambled(request: GenerateRequest):
    if request.prompt == "fail":
        return [ErrorReply(request.rid, 400, "prompt: too long", "invalid_request_error",
                           "prompt", "context_length_exceeded")]  # fmt: skip
    ordered = deltas(request.rid, PIECES, reason="length", prompt_tokens=6)
    return [ordered[2], ordered[1], ordered[1], ordered[0]]


@pytest.fixture
def config(redis_client, redis_url):
    return BusConfig(redis_url=redis_url)


@pytest.fixture
def upstream(config):
    with Upstream(config.redis_url, config, scrambled) as running:
        yield running


def test_generate_reassembles_scrambled_deltas(config, upstream):
    with Client(config.redis_url) as client:
        result = client.generate("Hi", sampling={"max_new_tokens": 4, "temperature": 0})
    assert result["text"] == "Hello!" and result["output_ids"] == [10, 11, 12, 13]
    assert result["finish_reason"] == "length" and result["matched_stop"] is None
    assert result["usage"] == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10,
                               "cached_tokens": 0}  # fmt: skip
    [request] = upstream.requests
    assert request.rid == result["rid"] and request.prompt == "Hi"
    assert request.sampling == {"max_new_tokens": 4, "temperature": 0}
    assert request.reply_to == client.reply_stream and request.created is not None


def test_stream_yields_chunks_in_order_and_the_last_has_usage(config, upstream):
    with Client(config=config) as client:
        rid = client.submit(input_ids=[1, 2, 3])
        chunks = list(client.stream(rid, timeout=2))
    assert [c["text"] for c in chunks] == ["Hel", "lo", "!"]
    assert [c["finish_reason"] for c in chunks] == [None, None, "length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and "usage" not in chunks[0]
    assert upstream.requests[0].input_ids == [1, 2, 3]  # packed int32 on the wire


def test_an_error_reply_raises_request_error(config, upstream):
    with Client(config=config) as client, pytest.raises(RequestError) as caught:
        client.generate("fail")
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")


def test_a_finish_of_reason_error_raises_request_error_naming_the_field(config):
    def midway(request: GenerateRequest):
        out = deltas(request.rid, [("{", [1])], reason="error", matched="regex cannot be...")
        out[-1].finish["param"] = "regex"
        return out

    with Upstream(config.redis_url, config, midway), Client(config=config) as client:
        rid = client.submit(input_ids=[1, 2])
        with pytest.raises(RequestError) as caught:
            list(client.stream(rid, timeout=2))
    error = caught.value
    assert (error.status, error.param, error.message) == (400, "regex", "regex cannot be...")


@pytest.mark.parametrize(
    ("job", "message"),
    [
        ({"prompt": "x", "sampling": {"temperature": -1}}, "temperature"),
        ({"prompt": "x", "sampling": {"bogus": 1}}, "bogus"),
        ({"prompt": "x", "input_ids": [1]}, "exactly one"),
        ({}, "exactly one"),
        ({"input_ids": [1, -1]}, "input_ids"),
    ],
)
def test_a_bad_job_is_a_value_error_and_nothing_is_queued(config, redis_client, job, message):
    with Client(config=config) as client:
        with pytest.raises(ValueError, match=message):
            client.submit_many([{"prompt": "fine"}, job])
    assert redis_client.xlen(config.requests_stream()) == 0


def test_logit_bias_and_stop_are_sent_in_wire_form(config, upstream):
    with Client(config=config) as client:
        client.generate("x", sampling={"logit_bias": {42: -3}, "stop": "\n"})
    assert upstream.requests[0].sampling == {"logit_bias": {"42": -3.0}, "stop": ["\n"]}


def test_submit_many_pipelines_thousands_of_jobs(config, upstream):
    with Client(config=config) as client:
        rids = client.submit_many([{"input_ids": [i + 1]} for i in range(2000)])
        assert len(set(rids)) == 2000
        texts = {"".join(c["text"] for c in client.stream(rid, timeout=5)) for rid in rids}
    assert texts == {"Hello!"}
    assert sorted(r.input_ids[0] for r in upstream.requests) == list(range(1, 2001))


def test_abort_flags_the_request_and_ends_the_stream(config, redis_client):
    with Client(config=config) as client:
        rid = client.submit("x")
        client.abort(rid)
        chunks = list(client.stream(rid, timeout=1))
    assert chunks == [{"rid": rid, "text": "", "output_ids": [], "finish_reason": "abort"}]
    assert redis_client.get(config.abort_key(rid)) == b"1"
    # The flag is the whole abort: the worker holding the job reads it (bus/aborts.py).
    assert not redis_client.keys(config.worker_stream("*"))


def test_close_deletes_the_reply_stream(config, upstream, redis_client):
    client = Client(config=config)
    client.generate("x")
    assert redis_client.exists(client.reply_stream)
    client.close()
    assert not redis_client.exists(client.reply_stream)


def test_the_url_comes_from_the_argument_the_config_or_the_environment(redis_url, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(ValueError, match="no Redis URL"):
        Client()
    monkeypatch.setenv("REDIS_URL", redis_url)
    with Client() as client:
        assert client.config.redis_url == redis_url
    with Client(config=BusConfig(stream_prefix="other")) as client:
        assert client.config.redis_url == redis_url
        assert client.reply_stream.startswith("other:reply:client-")


def test_async_client_generates_streams_and_aborts(config, upstream, redis_client):
    async def main():
        async with AsyncClient(config=config) as client:
            whole = await client.generate(messages=[{"role": "user", "content": "Hi"}])
            rids = await client.submit_many([{"prompt": "a"}, {"prompt": "b"}])
            streamed = []
            for rid in rids:
                streamed.append([c["text"] async for c in client.stream(rid, timeout=2)])
            with pytest.raises(RequestError):
                await client.generate("fail", timeout=2)
            silent = await client.submit("fail")  # answered with an error we never read...
            await client.abort(silent)  # ...because we abort it first
            ended = [c async for c in client.stream(silent, timeout=2)]
            return whole, streamed, ended, client.reply_stream

    whole, streamed, ended, stream = asyncio.run(main())
    assert whole["text"] == "Hello!" and whole["finish_reason"] == "length"
    assert streamed == [["Hel", "lo", "!"]] * 2
    assert ended[-1]["finish_reason"] == "abort"
    assert not redis_client.exists(stream)


def test_a_stream_cancelled_as_a_reply_arrives_ends_cancelled(config):
    # Python 3.11's asyncio.wait_for returned the reply and dropped the cancellation that
    # landed with it: the caller's task went on as if never cancelled.
    async def main() -> bool:
        async with AsyncClient(config=config) as client:
            rid = await client.submit("a")  # nobody answers: the test hands the reply
            chunks = []

            async def read() -> None:
                async for chunk in client.stream(rid, timeout=30):
                    chunks.append(chunk)

            task = asyncio.get_running_loop().create_task(read())
            await asyncio.sleep(0.05)  # the stream waits for its first reply
            client._queues[rid].put_nowait(TextDelta(rid, 0, [1], "Hi"))
            task.cancel()  # in the same turn
            await asyncio.wait([task], timeout=2)
            await client.abort(rid)
            return task.cancelled()

    assert asyncio.run(main())


def test_an_embedding_job_answers_its_vector(config):
    def embed(job: GenerateRequest):
        assert job.pooling == "last" and job.sampling == {"max_new_tokens": 0}
        return [embedding_delta(job.rid, [0.6, 0.8], prompt_tokens=2)]

    with Upstream(config.redis_url, config, embed), Client(config=config) as client:
        result = client.generate(input_ids=[1, 2], pooling="last", timeout=5)
        with pytest.raises(ValueError, match="pooling"):
            client.submit("hi", pooling="mean", sampling={"temperature": 0})
        with pytest.raises(ValueError, match="pooling"):
            client.submit("hi", pooling="max")
    assert result["embedding"] == pytest.approx([0.6, 0.8])
    assert result["finish_reason"] == "stop" and result["usage"]["prompt_tokens"] == 2
