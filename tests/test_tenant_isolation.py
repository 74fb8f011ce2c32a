"""Tenants own their files, batches, aborts and resumes: through the real ingress (its batch
runner included) with two API keys, every attempt on another key's data is the 404 a missing
id gets and leaves the owner's data as it was; with no keys configured all stays open."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time

import openai
import pytest

from bus.client import Client
from jobs.protocol import ENTRY_FIELD, encode
from stages.ingress.tenancy.ownership import key_owner, request_record
from stages.ingress.tenancy.tenants import Tenant, Tenants
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas, post_raw

KEYS = ("sk-a", "sk-b", "sk-team")
DEAD = "ingress-deadhost-9-abcdef"
CHAT = "/v1/chat/completions"


def answer(request):
    if "hang" in json.dumps(request.messages or request.prompt):
        return []  # never answered: a request that runs until aborted
    return deltas(request.rid, [("Hi", [1])])


@pytest.fixture
def ingress(redis_client, redis_url):
    tenants = Tenants({"sk-team": Tenant("team")})
    with RunningIngress(redis_url, api_keys=KEYS, tenants=tenants) as server:
        add_worker(redis_client, server.config)
        with Upstream(redis_url, server.config, answer):
            yield server


def client(ingress, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=ingress.url + "/v1", api_key=key, max_retries=0)


def jsonl(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def chat_line(i: int, text: str = "Hello") -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return {"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": body}


def upload(api: openai.OpenAI, lines: list[dict]):
    return api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")


def wait(api: openai.OpenAI, batch_id: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while (batch := api.batches.retrieve(batch_id)).status not in ("completed", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    return batch


def not_found(call, *args) -> dict:
    """The 404 body of `call`; it must be the one a missing id gets."""
    with pytest.raises(openai.NotFoundError) as refused:
        call(*args)
    return refused.value.body


def same_as_missing(body: dict, ident: str, missing: dict) -> bool:
    return body == json.loads(json.dumps(missing).replace("nope", ident))


def test_another_keys_file_is_a_404_and_stays_its_owners(ingress):
    a, b = client(ingress, "sk-a"), client(ingress, "sk-b")
    content = jsonl([chat_line(1)]).getvalue()
    mine = a.files.create(file=("in.jsonl", content), purpose="batch")
    missing = not_found(b.files.retrieve, "nope")
    for call in (b.files.retrieve, b.files.content, b.files.delete):
        assert same_as_missing(not_found(call, mine.id), mine.id, missing)
    assert mine.id not in [f.id for f in b.files.list()]
    assert a.files.retrieve(mine.id).id == mine.id
    assert a.files.content(mine.id).content == content
    assert [f.id for f in a.files.list()] == [mine.id]


def test_each_keys_list_pages_through_its_own_files_only(ingress):
    a, b = client(ingress, "sk-a"), client(ingress, "sk-b")
    made_a, made_b = [], []
    for i in range(3):  # interleaved, so a page of one key's would meet the other's
        made_a.append(upload(a, [chat_line(i)]).id)
        made_b.append(upload(b, [chat_line(i)]).id)
    seen, after = [], None
    while True:
        page = a.files.list(limit=1, **({"after": after} if after else {}))
        seen += [f.id for f in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert seen == made_a[::-1]
    assert [f.id for f in b.files.list()] == made_b[::-1]


def test_a_keys_batch_is_its_own_and_so_are_its_output_files(ingress):
    a, b = client(ingress, "sk-a"), client(ingress, "sk-b")
    with pytest.raises(openai.NotFoundError):  # b cannot run a batch of a's file
        b.batches.create(input_file_id=upload(a, [chat_line(0)]).id, endpoint=CHAT,
                         completion_window="24h")  # fmt: skip
    batch = a.batches.create(input_file_id=upload(a, [chat_line(0), chat_line(1)]).id,
                             endpoint=CHAT, completion_window="24h")  # fmt: skip
    missing = not_found(b.batches.retrieve, "nope")
    for call in (b.batches.retrieve, b.batches.cancel):
        assert same_as_missing(not_found(call, batch.id), batch.id, missing)
    assert batch.id not in [x.id for x in b.batches.list()]
    done = wait(a, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    for call in (b.files.retrieve, b.files.content):
        not_found(call, done.output_file_id)
    output = [json.loads(line) for line in a.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["line-0", "line-1"]
    assert [x.id for x in a.batches.list()] == [batch.id]
    # The output file is the batch owner's: listed for it, not for b.
    assert done.output_file_id in [f.id for f in a.files.list()]
    assert done.output_file_id not in [f.id for f in b.files.list()]


def test_a_listed_keys_tenant_owns_its_data_by_its_name(ingress, redis_client):
    team = client(ingress, "sk-team")
    made = upload(team, [chat_line(0)])
    assert redis_client.hget(f"streamserve:file:{made.id}", "owner") == b"team"
    assert made.id in [f.id for f in team.files.list()]
    not_found(client(ingress, "sk-a").files.retrieve, made.id)


def test_output_file_ids_are_random_not_the_batch_ids(ingress):
    a = client(ingress, "sk-a")
    batches = [a.batches.create(input_file_id=upload(a, [chat_line(0)]).id, endpoint=CHAT,
                                completion_window="24h") for _ in range(2)]  # fmt: skip
    outputs = [wait(a, x.id).output_file_id for x in batches]
    for batch, output in zip(batches, outputs, strict=True):
        short = batch.id.removeprefix("batch_")
        assert output.startswith("file-") and short not in output and len(output) == 29
    assert outputs[0] != outputs[1]


def _post(ingress, path: str, key: str, body: dict | None = None, headers: dict | None = None):
    return post_raw(ingress.url + path, body or {},
                    {"Authorization": f"Bearer {key}", **(headers or {})})  # fmt: skip


def test_only_its_owner_aborts_a_running_request(ingress, redis_client):
    def hang() -> None:
        with contextlib.suppress(OSError):  # cut when the ingress stops
            _post(ingress, "/v1/completions", "sk-a", {"model": MODEL, "prompt": "hang on"})

    threading.Thread(target=hang, daemon=True).start()
    deadline = time.monotonic() + 5
    while not (keys := redis_client.keys("streamserve:request:cmpl-*")):
        assert time.monotonic() < deadline, "the request was not submitted"
        time.sleep(0.05)
    request_id = keys[0].decode().rpartition(":")[2]
    for ident in (request_id, f"{request_id}-0"):
        status, data = _post(ingress, f"/v1/abort/{ident}", "sk-b")
        assert status == 404 and json.loads(data)["error"]["code"] == "request_not_found"
    assert not redis_client.exists(f"streamserve:abort:{request_id}-0")
    status, data = _post(ingress, f"/v1/abort/{request_id}", "sk-a")
    assert status == 200 and json.loads(data)["aborted"] == 1
    assert redis_client.exists(f"streamserve:abort:{request_id}-0")


def test_only_its_owner_resumes_a_stream(ingress, redis_client):
    config = ingress.config
    request_id = "cmpl-left-by-a-dead-ingress"
    redis_client.set(config.request_key(request_id), request_record(1, key_owner("sk-a")))
    for delta in deltas(f"{request_id}-0", [("Once", [1]), (" upon", [2])]):
        redis_client.xadd(config.reply_stream(DEAD), {ENTRY_FIELD: encode(delta)})
    body = {"model": MODEL, "prompt": "Tell me", "stream": True}
    resume = {"Last-Event-ID": f"{request_id}/{DEAD}/1"}
    status, data = _post(ingress, "/v1/completions", "sk-b", body, resume)
    assert status == 404 and json.loads(data)["error"]["code"] == "request_not_found"
    status, data = _post(ingress, "/v1/completions", "sk-a", body, resume)
    assert status == 200 and b" upon" in data and b"Once" not in data


def test_with_no_keys_configured_every_caller_and_direct_client_shares_all(redis_client, redis_url):
    with RunningIngress(redis_url) as server:
        a = client(server, "anything")
        made = upload(a, [chat_line(0)])
        b = client(server, "something-else")
        assert b.files.retrieve(made.id).id == made.id
        with Client(redis_url) as direct:
            assert direct.file_content(made.id) == a.files.content(made.id).content
            mine = direct.upload_batch_file(jsonl([chat_line(1)]).getvalue())
        assert {made.id, mine["id"]} <= {f.id for f in b.files.list()}
        assert b.files.delete(made.id).deleted
