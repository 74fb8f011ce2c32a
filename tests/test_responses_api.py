"""/v1/responses through the official `openai` client, with the pipeline played by a scripted
upstream on the real Redis: the chat job each request becomes, the Response objects and
stream events the replies become, stored responses and their owners, background responses.
(tests/test_responses_e2e.py runs the same API on the real default model.)"""

from __future__ import annotations

import json
import time

import openai
import pytest

from jobs.protocol import TextDelta
from stages.ingress.responses import background
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

KEYS = ("sk-a", "sk-b")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}


def answer(request):
    said = json.dumps(request.messages)
    if "hang" in said:
        return []  # never answered: runs until aborted
    if "unfinished" in said:
        return [TextDelta(request.rid, 0, [1], "Hi")]  # begun, never ended: until aborted
    if request.tools:
        return deltas(request.rid, [(CALL, [1, 2, 3])], prompt_tokens=9)
    if "long" in said:
        return deltas(request.rid, [("Hel", [1]), ("lo", [2])], reason="length")
    return deltas(request.rid, [("Hel", [10, 11]), ("lo", [12]), (" world", [13, 14])],
                  prompt_tokens=5, cached_tokens=2)  # fmt: skip


@pytest.fixture(scope="module")
def ingress(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushall()
    with RunningIngress(redis_url, api_keys=KEYS) as server:
        add_worker(client, server.config)
        with Upstream(redis_url, server.config, answer) as upstream:
            server.upstream = upstream
            yield server


def api(ingress, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=ingress.url + "/v1", api_key=key, max_retries=0, timeout=10)


def last_request(ingress):
    return ingress.upstream.requests[-1]


def completed(client: openai.OpenAI, response_id: str, timeout_s: float = 10.0):
    """The response, polled until it is completed."""
    deadline = time.monotonic() + timeout_s
    while (got := client.responses.retrieve(response_id)).status != "completed":
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    return got


def test_create_answers_a_typed_response_from_a_chat_job(ingress):
    response = api(ingress).responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=8,
        temperature=0.5, top_p=0.9,
    )  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.model == MODEL
    assert response.output_text == "Hello world"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5, 5)
    assert response.usage.total_tokens == 10
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert response.instructions == "Be brief." and response.max_output_tokens == 8
    job = last_request(ingress)
    assert job.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}]  # fmt: skip
    assert job.sampling == {"max_new_tokens": 8, "temperature": 0.5, "top_p": 0.9}
    assert job.rid == response.id + "-0"


def test_message_list_input_with_text_parts_and_roles(ingress):
    api(ingress).responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        {"type": "message", "role": "user", "content": "d"},
    ])  # fmt: skip
    assert last_request(ingress).messages == [
        {"role": "system", "content": "Rules."}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"},
    ]  # fmt: skip


def test_stream_sends_the_events_in_order_with_sequence_numbers(ingress):
    events = list(api(ingress).responses.create(model=MODEL, input="Hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "Hello world"
    )
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.status == "completed" and done.output_text == "Hello world"
    assert api(ingress).responses.retrieve(done.id).output_text == "Hello world"


def test_the_raw_stream_is_event_and_data_lines(ingress):
    status, headers, data = ingress.request("POST", "/v1/responses", {"input": "Hi",
                                            "stream": True})  # fmt: skip
    assert status == 401  # no key
    import urllib.request

    request = urllib.request.Request(
        ingress.url + "/v1/responses", data=json.dumps({"input": "Hi", "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-a"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        text = reply.read().decode()
    events = text.split("\n\n")
    assert len(events) > 2 and events[-1] == ""  # created ... completed, then the end
    for event in events[:-1]:
        kind, data_line = event.split("\n")
        assert kind.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["type"] == kind[7:]


def test_retrieve_delete_and_store_false(ingress):
    client = api(ingress)
    made = client.responses.create(model=MODEL, input="Hi")
    assert client.responses.retrieve(made.id).output_text == "Hello world"
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    unstored = client.responses.create(model=MODEL, input="Hi", store=False)
    assert unstored.output_text == "Hello world" and unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_puts_the_conversation_first(ingress):
    client = api(ingress)
    first = client.responses.create(model=MODEL, input="Hi", instructions="Only once.")
    second = client.responses.create(model=MODEL, input="Again", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert last_request(ingress).messages == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello world"},
        {"role": "user", "content": "Again"},
    ]  # fmt: skip
    client.responses.create(model=MODEL, input="Third", previous_response_id=second.id)
    assert [m["content"] for m in last_request(ingress).messages] == [
        "Hi", "Hello world", "Again", "Hello world", "Third"]  # fmt: skip
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nothing")
    assert missing.value.body["param"] == "previous_response_id"


def test_another_tenants_responses_are_not_found(ingress):
    mine = api(ingress, "sk-a").responses.create(model=MODEL, input="Hi")
    other = api(ingress, "sk-b")
    for attempt in (lambda: other.responses.retrieve(mine.id),
                    lambda: other.responses.delete(mine.id),
                    lambda: other.responses.cancel(mine.id),
                    lambda: other.responses.create(model=MODEL, input="x",
                                                   previous_response_id=mine.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert api(ingress, "sk-a").responses.retrieve(mine.id).output_text == "Hello world"


def test_function_tools_give_function_call_items_and_their_outputs_go_back(ingress):
    client = api(ingress)
    response = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER],
                                       tool_choice="required")  # fmt: skip
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    job = last_request(ingress)
    assert job.tools[0]["function"]["name"] == "get_weather" and "ebnf" in job.sampling
    client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    messages = last_request(ingress).messages
    assert messages[-2]["tool_calls"][0]["id"] == call.call_id
    assert messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER],
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done"]  # fmt: skip
    assert events[-1].response.output[0].name == "get_weather"


def test_json_schema_format_goes_to_the_grammar(ingress):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response = api(ingress).responses.create(
        model=MODEL, input="Hi",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )  # fmt: skip
    assert json.loads(last_request(ingress).sampling["json_schema"]) == schema
    assert response.text.format.type == "json_schema"


def test_max_output_tokens_cut_is_incomplete(ingress):
    response = api(ingress).responses.create(model=MODEL, input="long", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


def test_background_completes_and_is_polled(ingress):
    client = api(ingress)
    made = client.responses.create(model=MODEL, input="Hi", background=True)
    assert made.status in ("queued", "in_progress") and made.background
    assert completed(client, made.id).output_text == "Hello world"


def test_background_cancel_stops_its_job(ingress):
    client = api(ingress)
    made = client.responses.create(model=MODEL, input="hang", background=True)
    cancelled = client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.3)
    assert client.responses.retrieve(made.id).status == "cancelled"
    assert not ingress.app[background.TASKS]  # its task has ended
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model=MODEL, input="Hi").id)


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "background": True, "store": False}, "store"),
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),  # OpenAI's 512 characters
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),  # and 64 for a key
])  # fmt: skip
def test_user_errors_are_openai_error_bodies(ingress, body, param):
    status, _, data = ingress.request("POST", "/v1/responses", body)
    assert status == 401
    with pytest.raises(openai.APIStatusError) as error:
        api(ingress).post("/responses", body=body, cast_to=object)
    assert 400 <= error.value.status_code < 500
    assert error.value.body["param"] == param, error.value.body


def test_fields_sdks_send_by_default_are_taken_and_others_refused(ingress):
    client = api(ingress)
    taken = client.responses.create(model=MODEL, input="Hi", truncation="disabled", include=[],
                                    reasoning={"effort": None}, service_tier="auto",
                                    prompt_cache_key="k", safety_identifier="u")  # fmt: skip
    assert taken.output_text == "Hello world"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "high"})
    assert refused.value.body["param"] == "reasoning"
    # OpenAI's stream obfuscation: events here carry no padding, so only false is taken.
    events = list(
        client.responses.create(
            model=MODEL, input="Hi", stream=True, stream_options={"include_obfuscation": False}
        )
    )
    assert events[-1].type == "response.completed"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL, input="Hi", stream=True, stream_options={"include_obfuscation": True}
        )
    assert refused.value.body["param"] == "stream_options"


def test_a_stream_its_client_leaves_is_stored_cancelled(ingress):
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", ingress.port, timeout=5)
    connection.request(
        "POST",
        "/v1/responses",
        json.dumps({"input": "unfinished", "stream": True}),
        {"Content-Type": "application/json", "Authorization": "Bearer sk-a"},
    )
    reply = connection.getresponse()
    first = json.loads(_data_line(reply))
    assert first["type"] == "response.created"
    connection.close()
    deadline = time.monotonic() + 5
    while api(ingress).responses.retrieve(first["response"]["id"]).status != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _data_line(reply) -> str:
    while not (line := reply.fp.readline().decode()).startswith("data: "):
        pass
    return line.removeprefix("data: ")


DEAD = "ingress-deadhost-7-abcdef"


def _left_by_a_dead_ingress(
    ingress, response_id: str, frontend: str = DEAD, in_background: bool = False,
    submitted: bool = True,
) -> None:  # fmt: skip
    """What a replica killed while streaming `response_id` (or running it in the background)
    leaves in Redis: the stored response as it began, and once its job was `submitted` its
    request's key and its job's replies on its reply stream."""
    import redis

    from jobs.protocol import ENTRY_FIELD, encode
    from stages.ingress.responses.output import response_head
    from stages.ingress.tenancy.ownership import key_owner, request_record

    config, owner = ingress.config, key_owner("sk-a")
    body = {"input": "Hi", **({"background": True} if in_background else {"stream": True})}
    client = redis.Redis.from_url(config.redis_url)
    client.hset(config.key_name("response", response_id), mapping={
        "owner": owner, "status": "in_progress", "frontend": frontend,
        "body": json.dumps(response_head(response_id, MODEL, body, "in_progress")),
        "history": json.dumps([{"role": "user", "content": "Hi"}]), "request": json.dumps(body),
        **({"runner": frontend, "tenant": ""} if in_background else {}),
    })  # fmt: skip
    if in_background:
        client.sadd(config.key_name("responses", "background"), response_id)
    if not submitted:
        return
    client.set(config.request_key(response_id), request_record(1, owner))
    for delta in answer(type("Job", (), {"rid": response_id + "-0", "messages": [],
                                         "tools": None})()):  # fmt: skip
        client.xadd(config.reply_stream(frontend), {ENTRY_FIELD: encode(delta)})


def test_a_stream_whose_replica_died_resumes_after_its_last_event(ingress):
    client = api(ingress)
    _left_by_a_dead_ingress(ingress, "resp_dead1")
    whole = list(client.responses.retrieve("resp_dead1", stream=True))
    assert [e.sequence_number for e in whole] == list(range(11))
    assert whole[-1].type == "response.completed"
    _left_by_a_dead_ingress(ingress, "resp_dead2")
    rest = list(client.responses.retrieve("resp_dead2", stream=True, starting_after=5))
    assert [e.sequence_number for e in rest] == list(range(6, 11))
    assert [e.delta for e in rest if e.type == "response.output_text.delta"] == [" world"]
    assert rest[0].item_id == "msg_dead2_0" == whole[2].item.id.replace("dead1", "dead2")
    assert client.responses.retrieve("resp_dead2").output_text == "Hello world"
    with pytest.raises(openai.NotFoundError):  # it has ended
        list(client.responses.retrieve("resp_dead2", stream=True))
    with pytest.raises(openai.NotFoundError):  # another owner's
        list(api(ingress, "sk-b").responses.retrieve("resp_dead1", stream=True))


def test_a_resume_is_refused_while_its_replica_lives_or_if_it_never_streamed(ingress):
    client = api(ingress)
    _left_by_a_dead_ingress(ingress, "resp_alive", frontend=ingress.state.frontend_id)
    with pytest.raises(openai.ConflictError):
        list(client.responses.retrieve("resp_alive", stream=True))
    whole = client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError):
        list(client.responses.retrieve(whole.id, stream=True))


@pytest.mark.parametrize("submitted", [True, False], ids=["replies-read-again", "run-again"])
def test_a_background_response_whose_runner_died_is_taken_over(ingress, submitted):
    response_id = f"resp_orphan{int(submitted)}"
    before = len(ingress.upstream.requests)
    _left_by_a_dead_ingress(ingress, response_id, in_background=True, submitted=submitted)
    client = api(ingress)
    got = completed(client, response_id)
    assert got.output_text == "Hello world" and got.background
    rerun = [r for r in ingress.upstream.requests[before:] if r.rid == response_id + "-0"]
    assert len(rerun) == (0 if submitted else 1)  # submitted again only if it never was
    if not submitted:
        assert rerun[0].messages == [{"role": "user", "content": "Hi"}]


def test_what_no_replica_wrote_in_the_background_index_leaves_it_and_orphans_are_taken(ingress):
    # Anyone can write to Redis: an index member that is not UTF-8, or whose response names
    # a runner no replica could be (no key has such a name) or a status that is not text,
    # once failed every keeper's pass, so that no orphan was ever taken over again.
    import redis

    config = ingress.config
    client = redis.Redis.from_url(config.redis_url)
    index = config.key_name("responses", "background")
    client.hset(config.key_name("response", "resp_odd_runner"),
                mapping={"runner": "a:b", "status": "in_progress"})  # fmt: skip
    client.hset(config.key_name("response", "resp_odd_status"),
                mapping={"runner": DEAD, "status": b"\xff"})  # fmt: skip
    client.sadd(index, b"\xff\xfe", "resp_odd_runner", "resp_odd_status")
    _left_by_a_dead_ingress(ingress, "resp_orphan_beside", in_background=True, submitted=False)
    assert completed(api(ingress), "resp_orphan_beside").output_text == "Hello world"
    deadline = time.monotonic() + 10
    while client.smembers(index) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.smembers(index) == set()


def test_a_background_response_waits_for_a_live_worker(redis_url):
    import redis

    from runtime.config import BusConfig

    config = BusConfig(redis_url=redis_url, stream_prefix="no-worker-yet")
    with RunningIngress(redis_url, config) as server, Upstream(redis_url, config, answer):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.responses.create(model=MODEL, input="Hi")  # in the foreground: a 503
        assert refused.value.status_code == 503
        made = client.responses.create(model=MODEL, input="Hi", background=True)
        time.sleep(0.5)
        assert client.responses.retrieve(made.id).status == "queued"
        add_worker(redis.Redis.from_url(redis_url), config)
        assert completed(client, made.id).output_text == "Hello world"


def test_input_items_list_the_turns_own_input(ingress):
    client = api(ingress)
    first = client.responses.create(model=MODEL, input="Hi")
    [only] = client.responses.input_items.list(first.id).data
    assert (only.type, only.role, only.content[0].type, only.content[0].text) == (
        "message", "user", "input_text", "Hi")  # fmt: skip
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ])  # fmt: skip
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]
    assert listed.data[2].output == "ok" and listed.data[1].name == "f"
    newest = client.responses.input_items.list(second.id, limit=1)
    assert [i.type for i in newest.data] == ["function_call_output"] and newest.has_more
    rest = client.responses.input_items.list(second.id, limit=5, after=newest.data[0].id)
    assert [i.type for i in rest.data] == ["function_call", "message"] and not rest.has_more
    with pytest.raises(openai.NotFoundError):
        api(ingress, "sk-b").responses.input_items.list(second.id)
