"""A stream its client drops is charged to its key through the whole system: the worker's
last reply for the aborted request (its Finish, reason "abort") tells the ingress the prompt
and completion tokens it used, and they count against the key's tokens per minute."""

from __future__ import annotations

import http.client
import json
import time

import pytest
import redis

from stages.ingress.tenancy.tenants import KEY_LIMITS_ENV
from tests.pipeline_harness import QUICK_RECOVERY_ENV, Pipeline

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOKENS = "streamserve:tenant:default:tokens"
PROMPT = "Tell me a long story about a dragon. " * 20  # a prompt worth charging
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def pipeline():
    env = {**QUICK_RECOVERY_ENV,
           KEY_LIMITS_ENV: json.dumps({"default": {"tokens_per_minute": 10**7}})}  # fmt: skip
    with Pipeline(MODEL, env=env) as running:
        yield running


def charged(client: redis.Redis) -> int:
    return sum(int(tokens) for tokens in client.hgetall(TOKENS).values())


def settled(client: redis.Redis, timeout_s: float = 20.0) -> int:
    """The tokens charged once they stop changing (the charges' flushes are a second apart)."""
    deadline = time.monotonic() + timeout_s
    last, since = charged(client), time.monotonic()
    while time.monotonic() - since < 3:
        assert time.monotonic() < deadline, "the charges never settled"
        time.sleep(0.25)
        now = charged(client)
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_a_dropped_stream_is_charged_its_prompt_and_what_it_generated(pipeline):
    client = redis.Redis.from_url(pipeline.redis_url)
    status, whole = pipeline.post("/v1/completions",
                                  {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})  # fmt: skip
    assert status == 200
    prompt_tokens = whole["usage"]["prompt_tokens"]
    before = settled(client)

    connection = http.client.HTTPConnection("127.0.0.1", pipeline.port, timeout=60)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "ignore_eos": True}  # fmt: skip
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    received = b""
    while received.count(b"data:") < 4:
        received += response.read1(4096)
    connection.close()  # dropped well before its 400 tokens

    dropped = settled(client) - before
    # Its prompt was never in a reply the client read: only the abort's Finish told it.
    assert prompt_tokens + 3 <= dropped < prompt_tokens + MAX_TOKENS
    client.close()
