"""The ingress's OpenAI API through the official `openai` client and raw HTTP, with the
pipeline played by a scripted upstream on the real Redis."""

from __future__ import annotations

import json

import openai
import pytest

from jobs.protocol import TextDelta
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

HELLO = [("Hel", [10, 11]), ("lo", [12]), (" world", [13, 14])]


def hello(request):
    return deltas(request.rid, HELLO, prompt_tokens=5, cached_tokens=2)


@pytest.fixture
def ingress(redis_client, redis_url):
    with RunningIngress(redis_url) as server:
        add_worker(redis_client, server.config)
        yield server


@pytest.fixture
def client(ingress):
    return openai.OpenAI(base_url=ingress.url + "/v1", api_key="unused", max_retries=0, timeout=5)


def upstream(ingress, script=hello):
    return Upstream(ingress.config.redis_url, ingress.config, script)


def chat(client, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], **extra
    )


def test_chat_whole_response_has_openai_shape_and_usage(ingress, client):
    with upstream(ingress) as up:
        reply = chat(client, max_tokens=8)
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.id.startswith("chatcmpl-")
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == "Hello world"
    assert choice.finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (5, 5)
    assert reply.usage.total_tokens == 10
    assert reply.usage.prompt_tokens_details.cached_tokens == 2
    [request] = up.requests
    assert request.messages == [{"role": "user", "content": "Hi"}]
    assert request.sampling == {"max_new_tokens": 8}
    assert request.reply_to == ingress.config.reply_stream(ingress.state.frontend_id)
    assert request.created is not None


def test_chat_stream_chunks_role_first_finish_last_then_usage(ingress, client):
    with upstream(ingress):
        # include_obfuscation: false, as OpenAI's SDK may send it, changes nothing here.
        options = {"include_usage": True, "include_obfuscation": False}
        chunks = list(chat(client, stream=True, stream_options=options))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == "Hello world"
    assert [c.choices[0].finish_reason for c in content][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_is_sse_with_done_and_no_usage_unless_asked(ingress):
    with upstream(ingress):
        status, headers, data = ingress.request(
            "POST", "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        )  # fmt: skip
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    # OpenAI's shape, byte for byte: each event one `data:` line, no `id:` (event ids only for
    # clients that ask, stages/ingress/streaming/resume.py), as SSE readers such as `vllm
    # bench serve` expect.
    text = data.decode()
    assert text.startswith("data: {") and text.endswith("\n\ndata: [DONE]\n\n")
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    datas = events[:-2]
    assert all(d.startswith("data: {") and "\n" not in d for d in datas)
    payloads = [json.loads(d.removeprefix("data: ")) for d in datas]
    assert all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_whole_and_streamed(ingress, client):
    with upstream(ingress) as up:
        whole = client.completions.create(model=MODEL, prompt="Say", max_tokens=5, stop="\n")
        chunks = list(client.completions.create(model=MODEL, prompt="Say", stream=True))
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == "Hello world" and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == 5
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert up.requests[0].prompt == "Say"
    assert up.requests[0].sampling == {"max_new_tokens": 5, "stop": ["\n"]}
    assert up.requests[1].sampling == {}  # no max_tokens: up to the context length


def test_n_choices_get_numbered_rids_and_consecutive_seeds(ingress, client):
    def per_choice(request):
        i = request.rid.rsplit("-", 1)[1]
        return deltas(request.rid, [(f"choice {i}", [int(i) + 1])], prompt_tokens=4)

    with upstream(ingress, per_choice) as up:
        reply = chat(client, n=3, seed=7, temperature=0.8)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == ["choice 0", "choice 1", "choice 2"]
    assert sorted(r.sampling["seed"] for r in up.requests) == [7, 8, 9]
    assert sorted(r.rid for r in up.requests) == [f"{reply.id}-{i}" for i in range(3)]
    assert reply.usage.prompt_tokens == 4  # the prompt counts once
    assert reply.usage.completion_tokens == 3


def test_completions_prompt_list_and_token_ids_give_a_choice_per_prompt(ingress, client):
    with upstream(ingress) as up:
        reply = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], n=2)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    by_rid = {r.rid.rsplit("-", 1)[1]: r.input_ids for r in up.requests}
    assert by_rid == {"0": [1, 2, 3], "1": [1, 2, 3], "2": [4, 5], "3": [4, 5]}
    assert reply.usage.prompt_tokens == 10  # 5 per prompt, two prompts


def test_out_of_order_and_duplicate_deltas_are_assembled_in_order(ingress, client):
    def scrambled(request):
        ordered = deltas(request.rid, HELLO)
        return [ordered[2], ordered[0], ordered[0], ordered[1], ordered[2]]

    with upstream(ingress, scrambled):
        whole = chat(client)
        streamed = list(chat(client, stream=True))
    assert whole.choices[0].message.content == "Hello world"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Hello world"
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_message_content_parts_are_flattened_and_params_mapped(ingress, client):
    with upstream(ingress) as up:
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                             {"type": "text", "text": "there"}]},
            ],
            max_completion_tokens=9, temperature=0.5, top_p=0.9, stop=["x", "y"],
            frequency_penalty=0.1, presence_penalty=0.2, logit_bias={"42": -5}, user="u",
            extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
                        "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False},
        )  # fmt: skip
    [request] = up.requests
    assert request.messages[1] == {"role": "user", "content": "Hi there"}
    assert request.sampling == {
        "max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stop": ["x", "y"],
        "frequency_penalty": 0.1, "presence_penalty": 0.2, "logit_bias": {"42": -5.0},
        "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
        "min_new_tokens": 2, "skip_special_tokens": False,
    }  # fmt: skip


def with_logprobs(request):
    out = deltas(request.rid, [("Hi", [5]), ("!", [6])])
    out[0].logprobs, out[0].top_logprobs, out[0].token_texts = (
        [-0.5],
        [[[5, -0.5], [9, -1.5]]],
        ["Hi"],
    )
    out[1].logprobs, out[1].top_logprobs, out[1].token_texts = (
        [-0.25],
        [[[6, -0.25], [5, -2.0]]],
        ["!"],
    )
    return out


def test_chat_logprobs_are_formatted_as_openai(ingress, client):
    with upstream(ingress, with_logprobs) as up:
        reply = chat(client, logprobs=True, top_logprobs=2)
        streamed = list(chat(client, logprobs=True, top_logprobs=2, stream=True))
    assert up.requests[0].sampling == {"logprobs": True, "top_logprobs": 2}
    content = reply.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("Hi", -0.5, [72, 105]),
                                                                ("!", -0.25, [33])]  # fmt: skip
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hi", -0.5), ("<9>", -1.5)]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("!", -0.25), ("<5>", -2.0)]
    streamed_tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content]  # fmt: skip
    assert streamed_tokens == ["Hi", "!"]


def test_completion_logprobs_are_formatted_as_openai(ingress, client):
    with upstream(ingress, with_logprobs) as up:
        reply = client.completions.create(model=MODEL, prompt="x", logprobs=2)
    assert up.requests[0].sampling == {"logprobs": True, "top_logprobs": 2}
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == ["Hi", "!"]
    assert logprobs.token_logprobs == [-0.5, -0.25]
    assert logprobs.top_logprobs == [{"Hi": -0.5, "<9>": -1.5}, {"!": -0.25, "<5>": -2.0}]
    assert logprobs.text_offset == [0, 2]


def test_models_lists_the_served_name(ingress, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_native_generate_whole_and_streamed(ingress):
    with upstream(ingress) as up:
        status, whole = ingress.post(
            "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5}}
        )
        status_s, _, data = ingress.request("POST", "/generate", {"text": "Hi", "stream": True})
    assert status == 200
    assert whole["text"] == "Hello world" and whole["output_ids"] == [10, 11, 12, 13, 14]
    meta = whole["meta_info"]
    assert meta["id"] == up.requests[0].rid and meta["finish_reason"] == "stop"
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 5, 2)
    assert up.requests[0].input_ids == [1, 2] and up.requests[1].prompt == "Hi"
    events = [e.split("data: ")[-1] for e in data.decode().split("\n\n") if e]
    assert status_s == 200 and events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert "".join(e["text"] for e in parsed) == "Hello world"
    assert sum((e["output_ids"] for e in parsed), []) == [10, 11, 12, 13, 14]
    assert parsed[-1]["meta_info"]["finish_reason"] == "stop"


def test_top_k_minus_one_is_no_top_k_on_generate_as_on_the_openai_doors(ingress, client):
    """-1 is SGLang's default top_k (its /generate's clients send it) and vLLM's "off"."""
    sampling = {"max_new_tokens": 3, "top_k": -1, "temperature": 0.7}
    with upstream(ingress) as up:
        status, _ = ingress.post("/generate", {"text": "Hi", "sampling_params": sampling})
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"top_k": -1})
        status_k, _ = ingress.post("/generate", {"text": "Hi", "sampling_params": {"top_k": 5}})
    assert status == status_k == 200
    assert [r.sampling.get("top_k") for r in up.requests] == [None, None, 5]
    status, reply = ingress.post("/generate", {"text": "Hi", "sampling_params": {"top_k": -2}})
    assert status == 400 and reply["error"]["param"] == "top_k"


def test_empty_finish_delta_ends_the_stream_after_the_tokens_before_it(ingress, client):
    def late_finish(request):
        ordered = deltas(request.rid, HELLO)
        finish, ordered[-1].finish = ordered[-1].finish, None
        return [TextDelta(request.rid, 5, [], None, finish), *reversed(ordered)]

    with upstream(ingress, late_finish):
        chunks = list(chat(client, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"
