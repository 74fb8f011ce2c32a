"""The storage bounds of docs/BOUNDS.md: files and bytes per owner, file expiry, batch result
retention and batch line size, each past its bound a clear 4xx (or line error) naming it."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from batch_store.batches import BatchStore, error_line
from batch_store.files import FileStore
from batch_store.input_file import parse_input
from jobs.errors import RequestError
from runtime.config import BusConfig
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

CHAT = "/v1/chat/completions"
HOUR = 3600


def chat_line(i: int, text: str = "Hello") -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return {"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": body}


def jsonl(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def running(redis_client, redis_url, **settings):
    """An ingress whose config has `settings`, keys sk-a and sk-b, answering every job."""
    server = RunningIngress(redis_url, api_keys=("sk-a", "sk-b"))
    server.config = BusConfig(redis_url=redis_url, **settings)
    return server


def api(server, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def refused(call, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as error:
        call(**kwargs)
    return error.value.body


def wait(client: openai.OpenAI, batch_id: str):
    deadline = time.monotonic() + 20
    while (batch := client.batches.retrieve(batch_id)).status != "completed":
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)
    return batch


def test_an_owner_past_its_file_count_is_refused_naming_the_bound(redis_client, redis_url):
    with running(redis_client, redis_url, max_files_per_owner=2) as server:
        a = api(server)
        first = a.files.create(file=("1.jsonl", jsonl([chat_line(1)])), purpose="batch")
        a.files.create(file=("2.jsonl", jsonl([chat_line(2)])), purpose="batch")
        body = refused(a.files.create, file=("3.jsonl", jsonl([chat_line(3)])), purpose="batch")
        assert (body["code"], body["param"]) == ("too_many_files", "file")
        assert "max_files_per_owner" in body["message"]
        # Another owner has its own room; and a deleted file gives its room back.
        api(server, "sk-b").files.create(file=("b.jsonl", jsonl([chat_line(1)])), purpose="batch")
        a.files.delete(first.id)
        a.files.create(file=("3.jsonl", jsonl([chat_line(3)])), purpose="batch")


def test_an_owner_past_its_bytes_is_refused_naming_the_bound(redis_client, redis_url):
    content = jsonl([chat_line(1)]).getvalue()
    with running(redis_client, redis_url, max_bytes_per_owner=len(content) * 3 // 2) as server:
        a = api(server)
        a.files.create(file=("1.jsonl", content), purpose="batch")
        body = refused(a.files.create, file=("2.jsonl", content), purpose="batch")
        assert (body["code"], body["param"]) == ("storage_quota_exceeded", "file")
        assert "max_bytes_per_owner" in body["message"]
        api(server, "sk-b").files.create(file=("b.jsonl", content), purpose="batch")


def test_expires_after_sets_the_files_expiry_and_its_keys_ttl(redis_client, redis_url):
    with running(redis_client, redis_url) as server:
        a = api(server)
        made = a.files.create(file=("1.jsonl", jsonl([chat_line(1)])), purpose="batch",
                              expires_after={"anchor": "created_at", "seconds": HOUR})  # fmt: skip
        assert made.expires_at == made.created_at + HOUR
        assert HOUR - 5 <= redis_client.ttl(f"streamserve:file:{made.id}") <= HOUR
        plain = a.files.create(file=("2.jsonl", jsonl([chat_line(1)])), purpose="batch")
        assert plain.expires_at == plain.created_at + server.config.file_expiry_s
        for bad, param in (({"anchor": "created_at", "seconds": 60}, "expires_after[seconds]"),
                           ({"anchor": "last_active_at", "seconds": HOUR},
                            "expires_after[anchor]")):  # fmt: skip
            body = refused(a.files.create, file=("3.jsonl", jsonl([chat_line(1)])),
                           purpose="batch", expires_after=bad)  # fmt: skip
            assert body["param"] == param


@pytest.mark.parametrize("field, values", [("expires_after[seconds]", ["3600", "7200"]),
                                           ("purpose", ["batch", "batch"])])  # fmt: skip
def test_a_form_field_given_twice_is_refused_naming_it(redis_client, redis_url, field, values):
    import urllib.error
    import urllib.request

    fields = [("expires_after[anchor]", "created_at"), *((field, v) for v in values)]
    if field != "purpose":
        fields.append(("purpose", "batch"))
    parts = [f'--b\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
             for name, value in fields]  # fmt: skip
    upload = '--b\r\nContent-Disposition: form-data; name="file"; filename="1.jsonl"\r\n\r\n'
    body = ("".join(parts) + upload).encode() + jsonl([chat_line(1)]).read() + b"\r\n--b--\r\n"
    headers = {"Authorization": "Bearer sk-a", "Content-Type": "multipart/form-data; boundary=b"}
    with running(redis_client, redis_url) as server:
        request = urllib.request.Request(server.url + "/v1/files", body, headers)
        with pytest.raises(urllib.error.HTTPError) as refusal:
            urllib.request.urlopen(request, timeout=10)
    assert refusal.value.code == 400
    assert json.loads(refusal.value.read())["error"]["param"] == field


def test_an_expired_file_is_gone_from_reads_and_lists_and_frees_its_room(redis_client):
    config = BusConfig(redis_url="redis://unused", file_expiry_s=1, max_files_per_owner=1)
    files = FileStore(redis_client, config, owner="key-test")
    made = files.create(b'{"x": 1}\n', "in.jsonl", "batch")
    time.sleep(1.2)
    with pytest.raises(RequestError) as gone:
        files.get(made["id"])
    assert gone.value.status == 404
    assert files.list()["data"] == []
    again = files.create(b'{"x": 2}\n', "in.jsonl", "batch")  # the count no longer holds it
    assert redis_client.hkeys(files.owner_sizes("key-test")) == [again["id"].encode()]
    assert redis_client.zrange(files.owner_index("key-test"), 0, -1) == [again["id"].encode()]
    assert made["id"].encode() not in redis_client.zrange(files.index, 0, -1)


def test_a_finished_batchs_results_expire_and_its_counts_stay(redis_client, redis_url):
    with running(redis_client, redis_url, batch_result_ttl_s=120) as server:
        add_worker(redis_client, server.config)
        with Upstream(redis_url, server.config, lambda r: deltas(r.rid, [("Hi", [1])])):
            a = api(server)
            upload = a.files.create(file=("in.jsonl", jsonl([chat_line(0)])), purpose="batch")
            batch = a.batches.create(
                input_file_id=upload.id, endpoint=CHAT, completion_window="24h",
                output_expires_after={"anchor": "created_at", "seconds": 2 * HOUR},
            )  # fmt: skip
            done = wait(a, batch.id)
        out = f"streamserve:batch:{batch.id}:out"
        assert 0 < redis_client.ttl(out) <= 120
        redis_client.delete(out)  # as if it had expired
        assert a.batches.retrieve(batch.id).request_counts.completed == 1
        output = a.files.retrieve(done.output_file_id)
        assert output.expires_at == output.created_at + 2 * HOUR


def test_a_batch_line_past_the_line_bound_is_a_line_error_and_does_not_run(redis_client, redis_url):
    with running(redis_client, redis_url, max_batch_line_bytes=400) as server:
        add_worker(redis_client, server.config)
        script = lambda r: deltas(r.rid, [("Hi", [1])])  # noqa: E731
        with Upstream(redis_url, server.config, script) as upstream:
            a = api(server)
            lines = [chat_line(0), chat_line(1, "long " * 200)]
            upload = a.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = a.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                     completion_window="24h")  # fmt: skip
            done = wait(a, batch.id)
            assert len(upstream.requests) == 1
        errors = [json.loads(x) for x in a.files.content(done.error_file_id).text.splitlines()]
        assert [e["error"]["code"] for e in errors] == ["line_too_large"]
        assert "max_batch_line_bytes" in errors[0]["error"]["message"]
        assert done.request_counts.completed == 1 and done.request_counts.failed == 1


def test_parse_input_takes_a_line_at_the_bound_and_refuses_one_past_it():
    line = json.dumps(chat_line(0)).encode()
    good, bad = parse_input(line + b"\n", CHAT, 10, len(line))
    assert [g.custom_id for g in good] == ["line-0"] and bad == []
    good, bad = parse_input(line + b"\n", CHAT, 10, len(line) - 1)
    assert good == [] and [b.code for b in bad] == ["line_too_large"]


def test_a_batch_finished_again_rewrites_the_same_two_files(redis_client):
    """A runner that died finalizing leaves the batch to another, which finishes it again:
    the random ids are drawn once, so the owner is left one output and one error file."""
    config = BusConfig(redis_url="redis://unused")
    store = BatchStore(redis_client, config, owner="key-test")
    upload = store.files.create(jsonl([chat_line(0), chat_line(1)]).getvalue(), "in", "batch")
    batch = store.create(upload["id"], CHAT)
    store.begin(batch["id"], 2, {2: error_line("line-1", "invalid_body", "no")})
    store.record(batch["id"], 1, {"custom_id": "line-0"}, ok=True)
    first, again = store.finish(batch["id"], "completed"), store.finish(batch["id"], "completed")
    ids = (first["output_file_id"], first["error_file_id"])
    assert (again["output_file_id"], again["error_file_id"]) == ids
    assert sorted(f["id"] for f in store.files.list()["data"]) == sorted([upload["id"], *ids])
    assert again["request_counts"] == {"total": 2, "completed": 1, "failed": 1}


def test_an_owner_past_its_active_batches_is_refused_until_one_ends(redis_client):
    """Runners pick among every owner's batches not yet ended: one owner's thousands would
    crowd out the others' and make every runner's poll read them all."""
    config = BusConfig(redis_url="redis://unused", max_active_batches_per_owner=2)
    store = BatchStore(redis_client, config, owner="key-a")
    upload = store.files.create(jsonl([chat_line(0)]).getvalue(), "in", "batch")["id"]
    first, _ = store.create(upload, CHAT), store.create(upload, CHAT)
    with pytest.raises(RequestError) as error:
        store.create(upload, CHAT)
    assert (error.value.status, error.value.code) == (429, "too_many_active_batches")
    assert "max_active_batches_per_owner" in error.value.message
    other = BatchStore(redis_client, config, owner="key-b")  # its own room
    other.create(other.files.create(jsonl([chat_line(0)]).getvalue(), "in", "batch")["id"], CHAT)
    store.begin(first["id"], 1, {})
    store.finish(first["id"], "completed")  # an ended batch gives its room back
    third = store.create(upload, CHAT)
    store.retire_unreadable(third["id"])  # and so does one no runner can read
    store.create(upload, CHAT)
    assert len(store.active_ids()) == 3


@pytest.mark.parametrize(
    "metadata", [{"k": "v" * 513}, {"k" * 65: "v"}, {str(i): "v" for i in range(17)}]
)
def test_a_batchs_metadata_past_openais_bounds_is_refused(redis_client, metadata):
    """Kept with the batch's object and shown with it: 16 pairs, 64-character keys and
    512-character values, as OpenAI's."""
    store = BatchStore(redis_client, BusConfig(redis_url="redis://unused"), owner="key-m")
    upload = store.files.create(jsonl([chat_line(0)]).getvalue(), "in", "batch")["id"]
    with pytest.raises(RequestError) as error:
        store.create(upload, CHAT, metadata=metadata)
    assert (error.value.status, error.value.param) == (400, "metadata")
    store.create(upload, CHAT, metadata={"k" * 64: "v" * 512})


def test_an_ended_batch_expires_with_its_files_and_leaves_the_lists(redis_client):
    config = BusConfig(redis_url="redis://unused", max_active_batches_per_owner=1)
    store = BatchStore(redis_client, config, owner="key-e")
    upload = store.files.create(jsonl([chat_line(0)]).getvalue(), "in", "batch")["id"]
    failed = store.create(upload, CHAT)["id"]  # its file is found not to be a batch
    store.fail(failed, RequestError(400, "too many lines", code="too_many_lines"))
    got = store.get(failed)
    assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "too_many_lines"
    assert failed not in store.active_ids()
    assert 0 < redis_client.ttl(store.key(failed)) <= config.file_expiry_s
    done = store.create(upload, CHAT, output_expires_after={"anchor": "created_at",
                                                            "seconds": HOUR})["id"]  # fmt: skip
    store.begin(done, 1, {})
    store.record(done, 0, {"custom_id": "line-0"}, ok=True)
    store.finish(done, "completed")
    assert 0 < redis_client.ttl(store.key(done)) <= HOUR
    newest = [store.create(upload, CHAT)["id"]]
    for _ in range(3):
        store.cancel(newest[-1])
        store.finish(newest[-1], "cancelled")
        newest.append(store.create(upload, CHAT)["id"])
    redis_client.delete(store.key(done), store.key(newest[1]))  # as their expiry would
    page = store.list(limit=2)
    assert [b["id"] for b in page["data"]] == [newest[3], newest[2]] and page["has_more"]
    page = store.list(after=newest[2], limit=2)
    assert [b["id"] for b in page["data"]] == [newest[0], failed] and not page["has_more"]
    indexed = {i.decode() for i in redis_client.zrange(store.owner_index("key-e"), 0, -1)}
    assert done not in indexed and newest[1] not in indexed
