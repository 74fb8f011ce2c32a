"""A tenant that fills its quotas cannot fill Redis: with per-owner bounds below the server's
maxmemory, a key uploading and generating as much as it may leaves Redis under its limit,
and another key's uploads and requests are served meanwhile."""

from __future__ import annotations

import io

import openai
import redis

from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

MAXMEMORY = 64 * 2**20
FILE_BYTES = 2 * 2**20
QUOTA_FILES = 6  # 12 MiB per owner: a greedy owner ends far below the 64 MiB


def _file(seed: int) -> io.BytesIO:
    line = '{"custom_id": "x%d", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    text = (line % seed) + "#" * (FILE_BYTES - len(line))
    return io.BytesIO(text.encode()[:FILE_BYTES])


def test_a_tenant_at_its_quotas_leaves_redis_under_its_limit_and_others_served():
    with EmbeddedRedis(maxmemory=str(MAXMEMORY)) as server:
        client = redis.Redis.from_url(server.url)
        config = BusConfig(redis_url=server.url, max_files_per_owner=QUOTA_FILES,
                           max_bytes_per_owner=QUOTA_FILES * FILE_BYTES)  # fmt: skip
        ingress = RunningIngress(server.url, api_keys=("sk-greedy", "sk-other"))
        ingress.config = config
        with ingress, Upstream(server.url, config, lambda r: deltas(r.rid, [("ok", [1])])):
            add_worker(client, config)
            greedy = openai.OpenAI(base_url=ingress.url + "/v1", api_key="sk-greedy",
                                   max_retries=0)  # fmt: skip
            other = openai.OpenAI(base_url=ingress.url + "/v1", api_key="sk-other",
                                  max_retries=0)  # fmt: skip
            refusals = 0
            for i in range(3 * QUOTA_FILES):  # far past its quota: each past it is a 4xx
                try:
                    greedy.files.create(file=(f"{i}.jsonl", _file(i)), purpose="batch")
                except openai.BadRequestError as error:
                    assert error.body["code"] in ("too_many_files", "storage_quota_exceeded")
                    refusals += 1
            assert refusals == 2 * QUOTA_FILES
            used = int(client.info("memory")["used_memory"])
            assert used < MAXMEMORY * 0.6, used
            # The other tenant is served: an upload and a chat completion.
            assert other.files.create(file=("o.jsonl", _file(99)), purpose="batch").id
            answer = other.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}]
            )
            assert answer.choices[0].message.content == "ok"
        client.close()
