"""Quotas a client cannot game, at the ingress on the real Redis with a scripted upstream:
the priority a key may ask for, max_concurrent counted in sequences (n x prompts), and
tokens charged as they are generated, a dropped stream's included."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from jobs.protocol import Finish, TextDelta
from jobs.wire import ENTRY_FIELD, encode
from stages.ingress.tenancy.tenants import KEY_LIMITS_ENV, tenants_from_env
from tests.ingress_harness import MODEL, deltas, keyed_ingress

LIMITS = {
    "keys": {
        "sk-vip": {"name": "vip", "min_priority": -10},
        "sk-low": {"name": "low", "min_priority": 5},
        "sk-seq": {"name": "seq", "max_concurrent": 4},
        "sk-tpm": {"name": "tpm", "tokens_per_minute": 100_000},
        "sk-drop": {"name": "drop", "tokens_per_minute": 100_000},
    },
}
KEYS = ("sk-plain", *LIMITS["keys"])
DRIP = [TextDelta("", seq, [1] * 4, "four") for seq in (0, 4)]  # 8 tokens, no end


def script(request):
    if request.prompt == "hold":
        return []  # never answered: it runs until its client goes
    if request.prompt == "many":  # 100 replies of a token each
        return deltas(request.rid, [("x", [1])] * 100, prompt_tokens=7)
    if request.prompt == "drip" or request.input_ids is not None:
        return [TextDelta(request.rid, d.seq, d.ids, d.text) for d in DRIP]
    return deltas(request.rid, [("one", [1] * 8)], prompt_tokens=7)


@pytest.fixture(scope="module")
def ingress(redis_url):
    with keyed_ingress(redis_url, KEYS, LIMITS, script) as server:
        yield server


def connect(server, key: str, path: str, body: dict) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("POST", path, body=json.dumps(body),
                       headers={"Authorization": f"Bearer {key}",
                                "Content-Type": "application/json"})  # fmt: skip
    return connection


def complete(server, key: str, path: str = "/v1/completions", **fields):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, **fields}
    if path == "/generate":
        body = {"text": "hi", "sampling_params": fields}
    connection = connect(server, key, path, body)
    try:
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def wait_for(condition, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def charged(server, tenant: str) -> int:
    buckets = server.redis.hgetall(f"streamserve:tenant:{tenant}:tokens")
    return sum(int(tokens) for tokens in buckets.values())


# ---- priority -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_priority_below_a_keys_range_is_a_403_naming_priority(ingress, path):
    asked = len(ingress.upstream.requests)
    status, _, body = complete(ingress, "sk-plain", path, priority=-1)
    assert status == 403
    assert body["error"]["param"] == "priority"
    assert body["error"]["code"] == "priority_not_allowed"
    assert "-1" in body["error"]["message"]
    assert len(ingress.upstream.requests) == asked  # nothing was queued


def test_priority_within_a_keys_range_is_served_at_it(ingress):
    assert complete(ingress, "sk-plain", priority=0)[0] == 200
    assert complete(ingress, "sk-plain", priority=7)[0] == 200
    assert ingress.upstream.requests[-1].priority == 7
    assert complete(ingress, "sk-plain")[0] == 200
    assert "priority" not in ingress.upstream.requests[-1].sampling  # the default, 0
    assert ingress.upstream.requests[-1].priority is None


def test_a_key_given_a_wider_range_may_use_it(ingress):
    assert complete(ingress, "sk-vip", priority=-10)[0] == 200
    assert ingress.upstream.requests[-1].priority == -10
    status, _, body = complete(ingress, "sk-vip", priority=-11)
    assert status == 403 and body["error"]["param"] == "priority"


def test_a_key_with_a_raised_minimum_runs_at_it_when_it_asks_for_nothing(ingress):
    assert complete(ingress, "sk-low")[0] == 200
    assert ingress.upstream.requests[-1].priority == 5
    assert complete(ingress, "sk-low", priority=0)[0] == 403


@pytest.mark.parametrize("bad", [-(2**31) - 1, 2**31, 1.5, "0", True])
def test_a_bad_min_priority_is_refused_at_start(bad):
    raw = json.dumps({"keys": {"k": {"min_priority": bad}}})
    with pytest.raises(ValueError, match="min_priority"):
        tenants_from_env({KEY_LIMITS_ENV: raw})


# ---- max_concurrent counts sequences --------------------------------------------------------


def test_n_counts_against_max_concurrent(ingress):
    status, headers, body = complete(ingress, "sk-seq", n=5)  # 5 > 4, now or ever
    assert status == 400 and "Retry-After" not in headers
    assert body["error"]["param"] == "n" and body["error"]["code"] == "too_many_sequences"
    status, _, body = complete(ingress, "sk-seq", prompt=["a", "b", "c"], n=2)  # 6 > 4
    assert status == 400 and "6 sequences" in body["error"]["message"]

    held = connect(ingress, "sk-seq", "/v1/completions",
                   {"model": MODEL, "prompt": "hold", "max_tokens": 8, "n": 3})  # fmt: skip
    running = "streamserve:tenant:seq:running"
    wait_for(lambda: ingress.redis.zcard(running) == 3, what="3 slots for n=3")
    status, headers, body = complete(ingress, "sk-seq", n=2)  # 3 + 2 > 4: not now
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert complete(ingress, "sk-seq", n=1)[0] == 200  # 3 + 1 fit
    held.close()  # its client gone: its three slots are given back
    wait_for(lambda: ingress.redis.zcard(running) == 0, what="slots kept after the end")
    assert complete(ingress, "sk-seq", n=4)[0] == 200


# ---- tokens charged as generated ------------------------------------------------------------


def test_a_streams_tokens_are_charged_before_it_ends(ingress):
    body = {"model": MODEL, "prompt": "drip", "max_tokens": 64, "stream": True}
    stream = connect(ingress, "sk-tpm", "/v1/completions", body)
    response = stream.getresponse()
    assert response.status == 200
    received = b""
    while b"four" not in received:  # a chunk with generated text has come
        received += response.read1(4096)
    # 8 completion tokens relayed; the stream is still open, its prompt not yet known.
    wait_for(lambda: charged(ingress, "tpm") == 8, what="tokens not charged while running")
    stream.close()


def test_a_dropped_stream_is_charged_what_was_generated(ingress):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 64, "stream": True}
    stream = connect(ingress, "sk-drop", "/v1/completions", body)
    assert stream.getresponse().status == 200
    rid = ingress.upstream.requests[-1].rid
    # Its prompt of 3 token ids on submission, and the 8 tokens relayed so far.
    wait_for(lambda: charged(ingress, "drop") == 3 + 8, what="prompt or deltas not charged")
    stream.close()  # the client goes away before the end
    # The worker's last reply for the aborted request: 2 more tokens were generated.
    abort = TextDelta(rid, 8, [1, 1], "", finish=Finish("abort", None, 3, 10).to_wire())
    ingress.redis.xadd(ingress.state.reply_stream, {ENTRY_FIELD: encode(abort)})
    wait_for(lambda: charged(ingress, "drop") == 3 + 10, what="the abort's tokens uncharged")
    time.sleep(1.5)  # a flush later: charged once, not again
    assert charged(ingress, "drop") == 13


def test_a_finished_requests_prompt_is_charged_from_its_finish(ingress):
    before = charged(ingress, "tpm")
    assert complete(ingress, "sk-tpm")[0] == 200  # 7 prompt tokens, 8 completion
    wait_for(lambda: charged(ingress, "tpm") == before + 15, what="finish not charged")


def test_charging_costs_no_redis_command_per_token(ingress):
    def hincrby_calls() -> int:
        stats = ingress.redis.info("commandstats").get("cmdstat_hincrby", {})
        return int(stats.get("calls", 0))

    before, calls = charged(ingress, "tpm"), hincrby_calls()
    assert complete(ingress, "sk-tpm", prompt="many", max_tokens=100)[0] == 200
    wait_for(lambda: charged(ingress, "tpm") == before + 7 + 100, what="tokens uncharged")
    assert hincrby_calls() - calls <= 2  # at its release, and perhaps a second's flush


# ---- batch lines ----------------------------------------------------------------------------


def test_batch_lines_are_held_to_their_owners_range(ingress):
    import openai

    client = openai.OpenAI(base_url=ingress.url + "/v1", api_key="sk-low", max_retries=0)
    lines = [
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "hi", "max_tokens": 8, **extra}}
        for custom_id, extra in [("plain", {}), ("below", {"priority": 4}),
                                 ("lower", {"priority": 9})]
    ]  # fmt: skip
    content = "\n".join(json.dumps(line) for line in lines).encode()
    upload = client.files.create(file=("lines.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 30,
             "the batch did not complete")  # fmt: skip
    batch = client.batches.retrieve(batch.id)
    results = [json.loads(line) for file_id in (batch.output_file_id, batch.error_file_id)
               for line in client.files.content(file_id).text.splitlines()]  # fmt: skip
    status = {r["custom_id"]: r["response"]["status_code"] for r in results}
    assert status == {"plain": 200, "below": 403, "lower": 200}
    below = next(r for r in results if r["custom_id"] == "below")["response"]["body"]
    assert below["error"]["param"] == "priority"
    ran = {r.priority for r in ingress.upstream.requests[-2:]}
    assert ran == {5, 9}  # the owner's minimum for a line naming none, above batches' 1
