"""Tool calling through the whole system: `streamserve up` with the real default model, asked
through the official `openai` client. With `required` or a named function the answer is
always calls that parse and match the tools' schemas; the streamed calls are the whole
answer's; a tool's result goes back through the chat template; bad tool requests are 4xx.

SmolLM2's chat template knows nothing of tools, so these also hold the system prompt that
stands in for it (jobs/tool_format.py)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                       "maxLength": 30}}, "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
TOOLS = [WEATHER, TIME]


def _ask(client, messages=QUESTION, **extra):
    extra = {"max_tokens": 80, **extra}
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **extra)


def _valid_call(name: str, arguments: dict) -> bool:
    """The tools' schemas, checked by hand."""
    if name == "get_weather":
        city, unit = arguments.get("city"), arguments.get("unit")
        return (set(arguments) == {"city", "unit"} and isinstance(city, str) and len(city) <= 30
                and unit in ("celsius", "fahrenheit"))  # fmt: skip
    return name == "get_time" and set(arguments) == {"zone"} and len(arguments["zone"]) <= 30


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_required_answers_a_call_that_matches_the_schemas_greedy_and_sampled(openai_client):
    one = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120}
    greedy = _ask(openai_client, temperature=0, **one)
    sampled = _ask(openai_client, temperature=1.0, seed=3, n=3, **one)
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "tool_calls", choice.message
        [(name, arguments)] = _calls(choice.message)
        assert _valid_call(name, arguments), (name, arguments)
        assert choice.message.content is None
        assert choice.message.tool_calls[0].id.startswith("call_")


def test_parallel_calls_each_match_the_schemas(openai_client):
    # The grammar lets the model call again after each call; this small one often does,
    # until max_tokens cuts the last call off (left as content, not a call).
    answer = _ask(openai_client, tool_choice="required", temperature=0, max_tokens=120)
    choice = answer.choices[0]
    calls = _calls(choice.message)
    assert calls and all(_valid_call(name, args) for name, args in calls), calls
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids)
    if choice.finish_reason != "length":
        assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_a_named_function_is_called_once(openai_client):
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = _ask(openai_client, tool_choice=named, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    [(name, arguments)] = _calls(choice.message)
    assert name == "get_time" and _valid_call(name, arguments)


def test_parallel_tool_calls_false_allows_one_call(openai_client):
    answer = _ask(openai_client, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert len(answer.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_are_the_whole_answers(openai_client):
    one = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    whole = _ask(openai_client, **one).choices[0]
    stream = _ask(openai_client, **one, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            assert part.id is None or part.id.startswith("call_")
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.message.tool_calls]  # fmt: skip
    assert [calls[i] for i in sorted(calls)] == expected


def test_auto_renders_the_tools_and_streams_as_it_answers_whole(openai_client):
    plain = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40,
                                           temperature=0)  # fmt: skip
    whole = _ask(openai_client, tool_choice="auto", temperature=0, max_tokens=40)
    # The tools are in the prompt (the template has no tools: the stand-in system prompt).
    assert whole.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    stream = _ask(openai_client, tool_choice="auto", temperature=0, max_tokens=40, stream=True)
    text, calls, finish = "", [], None
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        calls += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    message = whole.choices[0].message
    assert text == (message.content or "")
    assert [c.function.name for c in calls] == [c.function.name for c in message.tool_calls or []]
    assert finish == whole.choices[0].finish_reason
    if message.tool_calls:
        assert finish == "tool_calls"


def test_tool_choice_none_renders_no_tools(openai_client):
    plain = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                           temperature=0)  # fmt: skip
    none = _ask(openai_client, tool_choice="none", temperature=0, max_tokens=20)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


def test_a_round_trip_sends_the_result_back_through_the_template(openai_client):
    first = _ask(openai_client, tool_choice="required", parallel_tool_calls=False, temperature=0)
    message = first.choices[0].message
    messages = [*QUESTION, message.model_dump(exclude_none=True)]
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result})
    second = _ask(openai_client, messages, temperature=0, max_tokens=30)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call and its result are in the prompt: it grew by at least their text.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 15


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
        ({"tool_choice": "sometimes"}, 400, "tool_choice"),
        ({"tools": [], "tool_choice": "auto"}, 400, "tools"),
        ({"tools": {"name": "f"}}, 422, "tools"),
        ({"tools": [WEATHER, WEATHER]}, 400, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, 400, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
          {"type": "nope"}}}], "tool_choice": "required"}, 400, "tools"),  # fmt: skip
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
         "tool_choice"),  # fmt: skip
        ({"messages": [{"role": "tool", "content": "21C"}]}, 400, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function":
          {"name": "get_weather", "arguments": "{not json"}}]}]}, 400, "messages"),  # fmt: skip
    ],
    ids=["unknown-function", "bad-choice", "no-tools", "tools-not-array", "duplicate",
         "bad-name", "bad-schema", "with-response-format", "tool-without-id", "bad-arguments"],
)  # fmt: skip
def test_a_bad_tool_request_is_a_4xx_naming_its_field(float32_pipeline, extra, status, param):
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 5, **extra}
    got, answer = float32_pipeline.post("/v1/chat/completions", body)
    assert got == status, answer
    assert answer["error"]["param"] == param, answer


# ---- strict arguments (issue 31): a call holds exactly the properties its tool declares ----

# No additionalProperties: JSON Schema would allow any other key; the grammar must not.
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convert an amount of money from one currency to another",
        "parameters": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                           "to": {"type": "string"}},
            "required": ["amount", "from", "to"],
        },
    },
}  # fmt: skip
MONEY = [{"role": "user", "content": "How much is 30 US dollars in euros?"}]
NAMED_CONVERT = {"type": "function", "function": {"name": "convert_currency"}}


def _convert(client, **extra):
    extra = {"max_tokens": 60, **extra}
    return client.chat.completions.create(model=MODEL, messages=MONEY, tools=[CONVERT], **extra)


def _strict_calls(choice) -> list[dict]:
    """The choice's calls, each with exactly the declared arguments; no markup left over."""
    calls = _calls(choice.message) if choice.message.tool_calls else []
    assert all(name == "convert_currency" and set(args) == {"amount", "from", "to"}
               for name, args in calls), calls  # fmt: skip
    assert "<tool_call>" not in (choice.message.content or ""), choice.message.content
    return calls


@pytest.mark.parametrize("tool_choice", ["required", NAMED_CONVERT], ids=["required", "named"])
def test_a_call_holds_exactly_the_declared_arguments_greedy_and_sampled(openai_client, tool_choice):
    one = {"tool_choice": tool_choice, "parallel_tool_calls": False}
    greedy = _convert(openai_client, temperature=0, **one)
    sampled = _convert(openai_client, temperature=1.0, seed=1, n=3, **one)
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "tool_calls", choice.message
        assert len(_strict_calls(choice)) == 1 and choice.message.content is None


def test_parallel_sampled_calls_leave_no_markup_in_the_content(openai_client):
    # The model may begin another call after each; max_tokens cuts the last one off.
    answer = _convert(openai_client, tool_choice="required", temperature=1.0, seed=1, n=3)
    for choice in answer.choices:
        assert _strict_calls(choice) and choice.message.content is None
        assert choice.finish_reason in ("tool_calls", "length")


def test_auto_calls_are_strict_and_its_text_free(openai_client):
    # This small model answers the question in text under auto; a call it opened would be
    # held to the declared arguments as under required (tests/test_strict_schema.py).
    greedy = _convert(openai_client, tool_choice="auto", temperature=0)
    sampled = _convert(openai_client, tool_choice="auto", temperature=1.0, seed=1, n=3)
    for choice in [*greedy.choices, *sampled.choices]:
        if _strict_calls(choice):
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content
