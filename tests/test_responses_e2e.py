"""The Responses API through the whole system: `streamserve up` with the real default model
and two API keys, asked through the official `openai` client, whose own types parse every
answer: create, stream (the events in order), retrieve, delete, a conversation continued by
previous_response_id, a json_schema answer, a tool call, background responses completed and
cancelled, another tenant's 404, and a stream resumed after its ingress is killed.
(tests/test_responses_api.py covers the shapes in detail on a scripted upstream.)"""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest

from stages.ingress.tenancy.auth import API_KEY_ENV
from tests.pipeline_harness import QUICK_RECOVERY_ENV, Pipeline

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 16}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def pipeline():
    env = {**QUICK_RECOVERY_ENV, API_KEY_ENV: "sk-a,sk-b"}
    with Pipeline(MODEL, env=env, worker_arg=["--dtype=float32"]) as running:
        yield running


@pytest.fixture(scope="module")
def client(pipeline):
    return openai.OpenAI(base_url=pipeline.url + "/v1", api_key="sk-a", max_retries=0)


def wait(client: openai.OpenAI, response_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.2)
    return response


def test_create_retrieve_delete(client):
    made = client.responses.create(input="Say hello.", instructions="Answer briefly.", **GREEDY)
    assert isinstance(made, openai.types.responses.Response)
    assert made.object == "response" and made.id.startswith("resp_") and made.model == MODEL
    assert made.status in ("completed", "incomplete") and made.output_text
    assert made.output[0].type == "message" and made.output[0].content[0].type == "output_text"
    usage = made.usage
    assert (
        usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    )
    got = client.responses.retrieve(made.id)
    assert got.output_text == made.output_text and got.usage == made.usage
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def test_stream_events_come_in_order_and_spell_the_answer(client):
    events = list(client.responses.create(input="Count to five.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = [i for i, kind in enumerate(kinds) if kind == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert deltas == list(range(4, 4 + len(deltas))) and len(deltas) > 1
    ending = "response." + ("completed" if events[-1].response.status == "completed"
                            else "incomplete")  # fmt: skip
    assert kinds[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", ending]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(events[i].delta for i in deltas)
    assert final.output_text == text == events[4 + len(deltas)].text
    assert client.responses.retrieve(final.id).output_text == text
    whole = client.responses.create(input="Count to five.", **GREEDY)
    assert whole.output_text == text  # greedy: the stream is the whole answer


def test_a_conversation_continues_by_previous_response_id(client):
    first = client.responses.create(input="My name is Ada. Remember it.", **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                     **GREEDY)  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text
    # The first turn (its input and its answer) came before the new input.
    alone = client.responses.create(input="What is my name?", store=False, **GREEDY)
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store: false kept nothing


def test_json_schema_answer_matches_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
              "population": {"type": "integer"}}, "required": ["city", "population"],
              "additionalProperties": False}  # fmt: skip
    answer = client.responses.create(
        input="Give the largest city of France and its population as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                         "strict": True}},
        **{**GREEDY, "max_output_tokens": 60},
    )  # fmt: skip
    assert answer.status == "completed", answer
    data = json.loads(answer.output_text)
    assert set(data) == {"city", "population"} and isinstance(data["population"], int)


def test_a_required_tool_choice_gives_a_function_call(client):
    answer = client.responses.create(input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice="required", parallel_tool_calls=False,
                                     **{**GREEDY, "max_output_tokens": 60})  # fmt: skip
    [call] = answer.output
    assert call.type == "function_call" and call.name == "get_weather", answer.output
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    assert answer.status == "completed"
    # The call's result goes back as the next turn's input.
    after = client.responses.create(previous_response_id=answer.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        **GREEDY)  # fmt: skip
    assert after.status in ("completed", "incomplete")


def test_background_responses_complete_or_are_cancelled(client):
    done = client.responses.create(input="Say hi.", background=True, **GREEDY)
    assert done.status == "queued" and done.background
    long = client.responses.create(input="Write a long story about a dragon.", background=True,
                                   model=MODEL, temperature=0, max_output_tokens=2000)  # fmt: skip
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    finished = wait(client, done.id)
    assert finished.status in ("completed", "incomplete") and finished.output_text
    time.sleep(1.0)  # its job's last replies, were any still coming, leave it cancelled
    assert client.responses.retrieve(long.id).status == "cancelled"


def test_another_tenants_key_gets_404(client, pipeline):
    mine = client.responses.create(input="Hello.", **GREEDY)
    other = openai.OpenAI(base_url=pipeline.url + "/v1", api_key="sk-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(input="And?", previous_response_id=mine.id, **GREEDY)
    assert client.responses.retrieve(mine.id).output_text == mine.output_text


def test_a_stream_whose_ingress_is_killed_resumes_from_its_last_sequence_number(client, pipeline):
    asked = {"input": "Tell a story about a river.", "model": MODEL, "temperature": 0,
             "max_output_tokens": 48}  # fmt: skip
    expected = client.responses.create(store=False, **asked).output_text
    stream = client.responses.create(stream=True, **asked)
    text, last, response_id = "", -1, None
    try:
        for event in stream:
            last = event.sequence_number
            response_id = response_id or event.response.id
            if event.type == "response.output_text.delta":
                text += event.delta
                if len(text) > 20 and pipeline.replica_pids("stage ingress"):
                    for pid in pipeline.replica_pids("stage ingress"):
                        os.kill(pid, signal.SIGKILL)
    except Exception:  # the client transport's error: the stream broke with its ingress
        pass
    assert text != expected, "the stream ended before its ingress was killed"
    deadline = time.monotonic() + 60
    while True:  # until the launcher's new ingress is up and the dead one's liveness expired
        try:
            rest = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
            break
        except (openai.APIConnectionError, openai.ConflictError):
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    text += "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == expected
    assert rest[-1].response.output_text == expected
    assert client.responses.retrieve(response_id).output_text == expected
