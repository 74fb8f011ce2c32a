"""Two replicas of every CPU stage and two workers: every request completes exactly once,
and the router spreads the work over both workers."""

from __future__ import annotations

import asyncio

import pytest
import redis

from tests.pipeline_harness import Pipeline

pytestmark = pytest.mark.slow

REQUESTS = 24


def test_two_replicas_of_each_stage_and_two_workers_complete_every_request_once():
    replicas = {"ingress": 2, "tokenizers": 2, "routers": 2, "detokenizers": 2, "workers": 2}
    with Pipeline(**replicas) as pipeline:
        import openai

        client = openai.AsyncOpenAI(base_url=pipeline.url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> tuple[str, int, str | None]:
            try:
                return await complete(i)
            except openai.APIStatusError as exc:  # say what the server said
                pytest.fail(f"request {i}: HTTP {exc.status_code} {exc.body}")
            except openai.APIConnectionError as exc:
                pytest.fail(f"request {i}: {exc!r} caused by {exc.__cause__!r}")

        async def complete(i: int) -> tuple[str, int, str | None]:
            stream = await client.completions.create(
                model=pipeline.model, prompt=f"Request {i}: the story begins",
                max_tokens=6 + i % 5, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            text, usage, finish = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return text, usage, finish

        async def run():
            return await asyncio.gather(*(one(i) for i in range(REQUESTS)))

        results = asyncio.run(run())
        for i, (text, completion_tokens, finish) in enumerate(results):
            assert completion_tokens == 6 + i % 5, (i, text)
            assert finish == "length"
            assert text
        routed = redis.Redis.from_url(pipeline.redis_url).hgetall(pipeline.config.routed_key())
        assert len(routed) == 2, routed
        assert sum(int(n) for n in routed.values()) == REQUESTS
        assert all(int(n) >= REQUESTS // 4 for n in routed.values()), routed
