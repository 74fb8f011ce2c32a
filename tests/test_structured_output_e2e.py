"""Structured output through the whole system: `streamserve up` with the real default model,
asked through the official `openai` client (response_format, `parse` with a pydantic model)
and through /generate (regex, ebnf). Every answer must parse and match its structure, greedy
or sampled, one choice or several."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"

# Nested objects, an enum, an integer with bounds and an array of bounded strings.
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "object", "properties": {"code": {"enum": ["FR", "DE", "IT"]}},
                    "required": ["code"], "additionalProperties": False},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "maxItems": 3},
    },
    "required": ["name", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}  # fmt: skip


class Capital(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    founded: int = pydantic.Field(ge=0, le=3000)


def _ask(client, content: str, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=160, **extra
    )


def _city_format(**options) -> dict:
    spec = {"name": "city", "schema": CITY_SCHEMA, **options}
    return {"type": "json_schema", "json_schema": spec}


def _is_city(value) -> bool:
    """CITY_SCHEMA, checked by hand."""
    return (
        isinstance(value, dict)
        and set(value) == {"name", "country", "population_millions", "landmarks"}
        and isinstance(value["name"], str) and len(value["name"]) <= 24
        and value["country"] in ({"code": "FR"}, {"code": "DE"}, {"code": "IT"})
        and type(value["population_millions"]) is int and 0 <= value["population_millions"] <= 100
        and isinstance(value["landmarks"], list) and len(value["landmarks"]) <= 3
        and all(isinstance(item, str) and len(item) <= 24 for item in value["landmarks"])
    )  # fmt: skip


def test_parse_with_a_pydantic_model_through_the_official_client(openai_client):
    completion = openai_client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe the capital of France as JSON."}],
        response_format=Capital,
        max_tokens=160,
        temperature=0,
    )
    answer = completion.choices[0].message.parsed
    assert isinstance(answer, Capital)
    assert completion.choices[0].finish_reason == "stop"


def test_a_nested_json_schema_holds_greedy_and_sampled_for_every_choice(openai_client):
    response_format = _city_format(strict=True)
    greedy = _ask(
        openai_client, "Tell me about Paris.", response_format=response_format, temperature=0
    )
    sampled = _ask(openai_client, "Tell me about a city.", response_format=response_format,
                   temperature=1.0, seed=7, n=3)  # fmt: skip
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop", choice.message.content
        assert _is_city(json.loads(choice.message.content)), choice.message.content


def test_json_object_mode_answers_a_json_object(openai_client):
    answer = _ask(openai_client, "Give me a JSON object about cats.",
                  response_format={"type": "json_object"}, temperature=0)  # fmt: skip
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_streamed_structured_output_is_the_whole_answer(openai_client):
    response_format = _city_format()
    whole = _ask(
        openai_client, "Tell me about Rome.", response_format=response_format, temperature=0
    )
    stream = _ask(openai_client, "Tell me about Rome.", response_format=response_format,
                  temperature=0, stream=True)  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content
    assert _is_city(json.loads(text))


@pytest.mark.parametrize(
    ("sampling", "matches"),
    [
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ],
    ids=["regex", "ebnf"],
)
def test_generate_output_matches_its_regex_or_grammar(float32_pipeline, sampling, matches):
    sampling = {**sampling, "max_new_tokens": 32}
    body = {"text": "Is the sky blue? Answer:", "sampling_params": sampling}
    status, answer = float32_pipeline.post("/generate", body)
    assert status == 200, answer
    assert matches(answer["text"]), answer
    assert answer["meta_info"]["finish_reason"] == "stop", answer


def test_a_schema_that_does_not_compile_is_a_400_before_anything_runs(openai_client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(openai_client, "Hi", response_format=bad)
    assert caught.value.body["param"] == "response_format"


def test_greedy_structured_output_is_the_same_under_ngram_speculation(openai_client):
    from tests.pipeline_harness import SPECULATIVE_WORKER, Pipeline

    city = '{"name":"Rome","country":{"code":"IT"},"population_millions":3,"landmarks":[]}'
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    asks = [  # the copied JSON gives the n-gram index drafts to propose
        dict(content=f"Copy this JSON exactly: {city}", response_format=_city_format()),
        dict(content="What is the weather in Rome?", tools=[weather], tool_choice="required"),
    ]  # fmt: skip

    def answers(client):
        return [_ask(client, temperature=0, **ask).choices[0] for ask in asks]

    plain = answers(openai_client)
    with Pipeline(MODEL, worker_arg=SPECULATIVE_WORKER) as spec:
        client = openai.OpenAI(base_url=spec.url + "/v1", api_key="unused", max_retries=0)
        drafted = answers(client)
        usage = _ask(client, temperature=0, **asks[0]).usage
    assert [c.message.content for c in drafted] == [c.message.content for c in plain]
    assert _is_city(json.loads(drafted[0].message.content))
    calls = [(t.function.name, t.function.arguments) for t in drafted[1].message.tool_calls]
    assert calls == [(t.function.name, t.function.arguments) for t in plain[1].message.tool_calls]
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0, usage
