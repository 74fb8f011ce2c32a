"""``/admin/weights`` on a real ingress and server: off (404) without an admin key, 401 for a
wrong one or an API key, 400/422 for a body that names no weights, each with an OpenAI-style
error body; a good call writes the fleet's record and GET follows the workers. And the
version a Finish names reaches OpenAI answers as ``system_fingerprint``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis

from jobs.protocol import Heartbeat, encode
from jobs.weights import WeightsRecord, weights_key
from runtime.config import BusConfig
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

ADMIN_KEY = "admin-secret"
API_KEY = "tenant-key"


def _call(server, method: str, key: str | None, body: Any = None, raw: bytes | None = None):
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server.url + "/admin/weights", data=data, method=method,
                                     headers=headers)  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def admin_ingress(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    with RunningIngress(redis_url, api_keys=(API_KEY,), admin_keys=(ADMIN_KEY,)) as server:
        add_worker(client, server.config)
        server.redis = client
        yield server


def test_without_an_admin_key_configured_the_admin_api_is_not_there(redis_url):
    redis.Redis.from_url(redis_url).flushall()
    with RunningIngress(redis_url) as server:
        for method in ("GET", "POST"):
            status, body = _call(server, method, "anything", {"model": "/w"})
            assert status == 404 and body["error"]["code"] == "admin_api_disabled"
    assert not redis.Redis.from_url(redis_url).exists(weights_key(server.config))


@pytest.mark.parametrize("key", [None, "wrong", API_KEY])
def test_a_wrong_or_missing_admin_key_is_a_401_and_changes_nothing(admin_ingress, key):
    for method in ("GET", "POST"):
        status, body = _call(admin_ingress, method, key, {"model": "/w"})
        assert status == 401 and body["error"]["code"] == "invalid_admin_key"
    assert not admin_ingress.redis.exists(weights_key(admin_ingress.config))


@pytest.mark.parametrize(
    "body, raw, status, param",
    [
        (None, b"{not json", 400, None),
        ([1], None, 422, None),
        ({}, None, 400, "model"),
        ({"model": ""}, None, 400, "model"),
        ({"model": 5}, None, 400, "model"),
        ({"model": "a\nb"}, None, 400, "model"),
        ({"model": "/w", "dtype": "float16"}, None, 400, "dtype"),
    ],
)  # fmt: skip
def test_a_body_that_names_no_weights_is_a_4xx_with_the_reason(
    admin_ingress, body, raw, status, param
):
    got, answer = _call(admin_ingress, "POST", ADMIN_KEY, body, raw)
    assert got == status, answer
    assert answer["error"]["message"] and answer["error"]["param"] == param
    assert not admin_ingress.redis.exists(weights_key(admin_ingress.config))


def test_an_update_writes_the_record_and_get_follows_the_workers(admin_ingress):
    status, answer = _call(admin_ingress, "POST", ADMIN_KEY, {"model": "/ckpt/b"})
    assert status == 202
    version = answer["desired"]["version"]
    assert version.startswith("w1-") and answer["desired"]["source"] == "/ckpt/b"
    record = WeightsRecord.from_mapping(
        admin_ingress.redis.hgetall(weights_key(admin_ingress.config))
    )
    assert (record.source, record.version) == ("/ckpt/b", version)
    assert answer["converged"] is False  # the worker has not said it serves it
    # The worker reports the new version: the fleet has converged.
    config = admin_ingress.config
    beat = Heartbeat("w0", config.worker_stream("w0"), MODEL, 0, 0, 1000, 1000, 0, 0.0,
                     weights_version=version)  # fmt: skip
    admin_ingress.redis.set(config.heartbeat_key("w0"), encode(beat), ex=60)
    status, view = _call(admin_ingress, "GET", ADMIN_KEY)
    assert status == 200 and view["converged"] is True
    assert view["workers"] == [{"id": "w0", "version": version, "updating_to": None,
                                "error": None}]  # fmt: skip
    # A second update is a new version.
    _, again = _call(admin_ingress, "POST", ADMIN_KEY, {"model": "/ckpt/b"})
    assert again["desired"]["version"].startswith("w2-")


def test_the_version_a_finish_names_is_the_answers_system_fingerprint(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushall()

    def answer(job):
        replies = deltas(job.rid, [("Hi", [1]), ("!", [2])])
        # As the detokenizer writes them: the first delta names the weights, and the Finish.
        replies[0].weights_version = "w3-0123abcd"
        replies[-1].finish["weights_version"] = "w3-0123abcd"
        return replies

    with RunningIngress(redis_url) as server:
        add_worker(client, server.config)
        with Upstream(redis_url, server.config, answer):
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            status, whole = server.post("/v1/chat/completions", chat)
            assert status == 200 and whole["system_fingerprint"] == "w3-0123abcd"
            status, _, raw = server.request(
                "POST", "/v1/chat/completions",
                {**chat, "stream": True, "stream_options": {"include_usage": True}},
            )  # fmt: skip
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]  # fmt: skip
    # Every chunk names them, as OpenAI's do: the first from the request's first delta.
    assert len(chunks) >= 3 and chunks[-1]["usage"]
    assert {c["system_fingerprint"] for c in chunks} == {"w3-0123abcd"}


def test_the_cli_sets_the_record_and_shows_each_workers_version(redis_url, capsys):
    from cli.main import main

    client = redis.Redis.from_url(redis_url)
    client.flushall()
    assert main(["weights", "update", "", "--redis-url", redis_url]) == 2  # names nothing
    assert "model must be a non-empty string" in capsys.readouterr().err
    assert main(["weights", "update", "/ckpt/c", "--redis-url", redis_url]) == 0
    record = WeightsRecord.from_mapping(client.hgetall(weights_key(BusConfig(redis_url=redis_url))))
    assert record.source == "/ckpt/c" and record.version in capsys.readouterr().err
    config = BusConfig(redis_url=redis_url)
    beat = Heartbeat("w7", config.worker_stream("w7"), MODEL, 0, 0, 1000, 1000, 0, 0.0,
                     weights_version="w0-0", weights_error=f"{record.version}: no")  # fmt: skip
    client.sadd(config.workers_key(), "w7")
    client.set(config.heartbeat_key("w7"), encode(beat), ex=60)
    assert main(["weights", "status", "--json", "--redis-url", redis_url]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["desired"]["version"] == record.version and view["converged"] is True
    assert view["workers"][0]["error"] == f"{record.version}: no"
    # --wait gives up after its timeout while a worker has not got there: exit 1, and why.
    argv = ["weights", "update", "/ckpt/d", "--redis-url", redis_url, "--wait", "--timeout", "1"]
    assert main(argv) == 1
    assert "not every worker serves" in capsys.readouterr().err
