"""One owner's stored responses are bounded (stages/ingress/responses/quota.py): past
``max_responses_per_owner`` or ``max_response_bytes_per_owner`` its oldest responses go to
make room, and no other owner's. Before, every stored response stayed its 30 days, a failed
background one with its whole prompt: one tenant could fill the Redis all tenants share."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import redis
import redis.asyncio as aredis

from runtime.config import BusConfig
from stages.ingress.responses.quota import ResponseQuota
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

KEYS = ("sk-a", "sk-b")
MOST = 5


@pytest.fixture
def ingress(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    config = BusConfig(redis_url=redis_url, max_responses_per_owner=MOST,
                       max_response_bytes_per_owner=200_000)  # fmt: skip
    with RunningIngress(redis_url, config, api_keys=KEYS) as server:
        add_worker(client, server.config)
        with Upstream(redis_url, server.config, lambda r: deltas(r.rid, [("Hello", [1])])):
            server.redis = client
            yield server
    client.close()


def api(ingress, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=ingress.url + "/v1", api_key=key, max_retries=0, timeout=10)


def _stored(ingress, response_id: str) -> bool:
    return ingress.redis.exists(ingress.config.key_name("response", response_id)) == 1


def test_past_the_count_the_owners_oldest_responses_go_and_no_one_elses(ingress):
    other = api(ingress, "sk-b").responses.create(model=MODEL, input="kept")
    client = api(ingress)
    made = [client.responses.create(model=MODEL, input=f"turn {i}").id for i in range(MOST + 3)]
    for gone in made[:3]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        assert not _stored(ingress, gone)
    assert [client.responses.retrieve(i).output_text for i in made[3:]] == ["Hello"] * MOST
    assert api(ingress, "sk-b").responses.retrieve(other.id).output_text == "Hello"
    # The newest continues its conversation; the oldest can no longer be continued.
    client.responses.create(model=MODEL, input="more", previous_response_id=made[-1])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="more", previous_response_id=made[0])


def test_past_the_bytes_the_oldest_go_and_a_delete_gives_its_room_back(ingress):
    client = api(ingress)
    big = "word " * 15_000  # ~75 KB of input, kept twice (history, request): ~150 KB stored
    first = client.responses.create(model=MODEL, input=big).id
    second = client.responses.create(model=MODEL, input=big).id
    assert not _stored(ingress, first) and _stored(ingress, second)
    client.responses.delete(second)
    third = client.responses.create(model=MODEL, input="small").id
    fourth = client.responses.create(model=MODEL, input=big).id
    assert _stored(ingress, third) and _stored(ingress, fourth)


def test_the_count_forgets_what_expired_and_stays_within_its_bounds(redis_url):
    config = BusConfig(redis_url=redis_url, max_responses_per_owner=3,
                       max_response_bytes_per_owner=10_000, response_ttl_s=1)  # fmt: skip

    async def run() -> tuple[list[list[str]], tuple[int, int], tuple[int, int]]:
        client = aredis.Redis.from_url(redis_url)
        await client.flushall()
        quota = ResponseQuota(client, config)
        index = config.key_name("responses", "background")

        async def store(owner: str, rid: str, text: str) -> list[str]:
            fields = {"owner": owner, "body": json.dumps({"id": rid}), "history": text}
            key = config.key_name("response", rid)
            return await quota.store(owner, rid, key, index, fields, background=False)

        dropped = [await store("a", f"r{i}", "x" * 100) for i in range(5)]
        await asyncio.sleep(2.1)  # all of a's expire: forgotten, not dropped, by the next
        dropped.append(await store("a", "late", "x" * 100))
        after_expiry = await quota.usage("a")
        dropped.append(await store("b", "huge", "x" * 20_000))  # alone past the bytes: kept
        usage_b = await quota.usage("b")
        await client.aclose()
        return dropped, after_expiry, usage_b

    dropped, after_expiry, usage_b = asyncio.run(run())
    assert dropped == [[], [], [], ["r0"], ["r1"], [], []]
    assert after_expiry[0] == 1 and 100 < after_expiry[1] < 400
    assert usage_b[0] == 1 and usage_b[1] > 20_000
