"""Per-API-key tenants at the ingress: their jobs carry the tenant and its weight, and past a
key's concurrent-request or tokens-per-minute limit a request gets a 429 with Retry-After
while other keys go on. The ingress runs on the real Redis with a scripted upstream."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from stages.ingress.tenancy.tenants import KEY_LIMITS_ENV, Tenants, tenants_from_env
from tests.ingress_harness import MODEL, deltas, keyed_ingress

LIMITS = {
    "default": {"weight": 1},
    "keys": {
        "sk-a": {"name": "team-a", "weight": 2, "max_concurrent": 1},
        "sk-t": {"name": "team-t", "tokens_per_minute": 20},
    },
}
KEYS = ("sk-a", "sk-b", "sk-t")


def script(request):
    if request.prompt == "hold":
        return []  # never answered: it runs until its client goes
    return deltas(request.rid, [("one", [1] * 8)], prompt_tokens=7)  # 15 tokens


@pytest.fixture(scope="module")
def ingress(redis_url):
    with keyed_ingress(redis_url, KEYS, LIMITS, script) as server:
        yield server


def complete(server, key: str, prompt: str = "hi", timeout: float = 10):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8})
    connection.request("POST", "/v1/completions", body=body,
                       headers={"Authorization": f"Bearer {key}",
                                "Content-Type": "application/json"})  # fmt: skip
    try:
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def test_jobs_carry_their_tenant_and_its_weight(ingress):
    assert complete(ingress, "sk-a")[0] == 200
    assert complete(ingress, "sk-b")[0] == 200
    (a,), (b,) = ingress.upstream.requests[-2:-1], ingress.upstream.requests[-1:]
    assert (a.tenant, a.weight) == ("team-a", 2.0)
    assert (b.tenant, b.weight) == ("default", 1.0)  # a key without limits of its own


def test_a_key_past_its_concurrent_requests_gets_429_and_others_go_on(ingress, redis_client):
    held = http.client.HTTPConnection("127.0.0.1", ingress.port, timeout=10)
    held.request("POST", "/v1/completions", headers={"Authorization": "Bearer sk-a"},
                 body=json.dumps({"model": MODEL, "prompt": "hold", "max_tokens": 8}))  # fmt: skip
    running = "streamserve:tenant:team-a:running"
    deadline = time.monotonic() + 10
    while redis_client.zcard(running) < 1:  # team-a's one slot, taken by the held request
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, headers, body = complete(ingress, "sk-a")
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert "running" in body["error"]["message"] and int(headers["Retry-After"]) >= 1
    assert complete(ingress, "sk-b")[0] == 200
    held.close()  # its client gone, the ingress aborts it and gives the slot back
    deadline = time.monotonic() + 10
    while complete(ingress, "sk-a")[0] != 200:
        assert time.monotonic() < deadline, "team-a's slot was never given back"
        time.sleep(0.2)
    while redis_client.zcard(running):  # each is given back as its request ends
        assert time.monotonic() < deadline, "a slot was kept after its request ended"
        time.sleep(0.05)


def test_a_key_past_its_tokens_per_minute_gets_429_with_retry_after(ingress):
    assert complete(ingress, "sk-t")[0] == 200  # 15 tokens
    assert complete(ingress, "sk-t")[0] == 200  # 15 < 20 before it: let in, now 30
    status, headers, body = complete(ingress, "sk-t")
    assert status == 429 and "20 tokens per minute" in body["error"]["message"]
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert complete(ingress, "sk-b")[0] == 200


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{not json", "not JSON"),
        ('{"keys": {"k": {"weight": 0}}}', "weight"),
        ('{"keys": {"k": {"max_concurrent": 1.5}}}', "max_concurrent"),
        ('{"keys": {"k": {"rpm": 1}}}', "fields among"),
        ('{"keys": {"k": {"name": "x"}, "j": {"name": "x"}}}', "share a name"),
        ('{"tenants": {}}', '"default" and "keys"'),
    ],
)
def test_bad_limits_are_refused_at_start_saying_what(raw, says):
    with pytest.raises(ValueError, match=says) as error:
        tenants_from_env({KEY_LIMITS_ENV: raw})
    assert KEY_LIMITS_ENV in str(error.value) and 'k"' not in str(error.value)


def test_limits_come_from_a_file_and_a_key_never_shows_in_its_tenant_id(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"keys": {"sk-secret": {"tokens_per_minute": 5}}}))
    tenants = tenants_from_env({KEY_LIMITS_ENV: str(path)})
    tenant = tenants.for_key("sk-secret")
    assert tenant.tokens_per_minute == 5 and "secret" not in tenant.id
    assert tenants.for_key(None) is tenants.default and Tenants().default.limited is False
