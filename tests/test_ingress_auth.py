"""API keys at the ingress: 401 with OpenAI's body without a valid key, open health checks."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from stages.ingress.tenancy.auth import api_keys_from_env
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url, api_keys=("key-one", "key-two")) as server:
        add_worker(redis_client, server.config)
        yield server


def _get(ingress, path: str, authorization: str | None = None) -> tuple[int, dict, bytes]:
    headers = {"Authorization": authorization} if authorization else {}
    request = urllib.request.Request(ingress.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "key-one", "Basic key-one"])
def test_a_missing_or_wrong_key_is_a_401_with_an_openai_body(ingress, authorization):
    status, headers, body = _get(ingress, "/v1/models", authorization)
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_every_configured_key_opens_the_api(ingress):
    for key in ("key-one", "key-two"):
        assert _get(ingress, "/v1/models", f"Bearer {key}")[0] == 200
    import openai

    client = openai.OpenAI(base_url=ingress.url + "/v1", api_key="key-two", max_retries=0)
    with Upstream(ingress.config.redis_url, ingress.config, lambda r: deltas(r.rid, [("Hi", [1])])):
        reply = client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert reply.choices[0].text == "Hi"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=ingress.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_health_metrics_and_the_description_stay_open(ingress):
    for path in ("/health", "/metrics", "/openapi.json"):
        assert _get(ingress, path)[0] == 200, path


def test_keys_come_from_the_environment_comma_separated():
    assert api_keys_from_env({}) == ()
    assert api_keys_from_env({"STREAMSERVE_API_KEY": " a, b ,,"}) == ("a", "b")
