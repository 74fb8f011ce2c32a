"""OpenAI's Batch API through the whole system, with the official `openai` client unchanged:
files round trip, batches of chat and completions lines answered once each (and equal to
the same requests sent one by one), bad lines in the error file, cancel, and the errors a
user can make."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest
import redis

from stages.ingress.tenancy.tenants import KEY_LIMITS_ENV
from tests.pipeline_harness import QUICK_RECOVERY_ENV, Pipeline

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def float32_pipeline():
    """conftest's, with its clients allowed priorities down to -10 (by default no key may
    ask for one below 0), as a test here sends one."""
    limits = json.dumps({"default": {"min_priority": -10}})
    env = {**QUICK_RECOVERY_ENV, KEY_LIMITS_ENV: limits}
    with Pipeline(MODEL, env=env, worker_arg=["--dtype=float32"]) as running:
        yield running


def jsonl(lines: list) -> io.BytesIO:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return io.BytesIO(text.encode() + b"\n")


def chat_line(i: int, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    return {"custom_id": f"chat-{i}", "method": "POST", "url": CHAT, "body": body}


def completion_line(i: int) -> dict:
    body = {"model": MODEL, "prompt": f"The number {i} is", "max_tokens": 8, "temperature": 0}
    return {"custom_id": f"cmpl-{i}", "method": "POST", "url": COMPLETIONS, "body": body}


def submit(client: openai.OpenAI, lines: list, endpoint: str) -> openai.types.Batch:
    upload = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint,
                                 completion_window="24h")  # fmt: skip


def wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 240.0) -> openai.types.Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.5)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_files_round_trip(openai_client):
    content = jsonl([chat_line(1)]).getvalue()
    made = openai_client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert (made.object, made.purpose, made.bytes, made.filename) == (
        "file", "batch", len(content), "mine.jsonl")  # fmt: skip
    assert openai_client.files.retrieve(made.id).id == made.id
    assert openai_client.files.content(made.id).content == content
    assert made.id in [f.id for f in openai_client.files.list(purpose="batch")]
    assert openai_client.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(made.id)
    assert made.id not in [f.id for f in openai_client.files.list()]


@pytest.mark.parametrize(
    ("make", "endpoint", "count"), [(chat_line, CHAT, 30), (completion_line, COMPLETIONS, 20)]
)
def test_a_batch_answers_every_line_once_as_the_same_request_alone(
    openai_client, make, endpoint, count
):
    lines = [make(i) for i in range(count)]
    batch = submit(openai_client, lines, endpoint)
    assert batch.status == "validating" and batch.endpoint == endpoint
    done = wait(openai_client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (count, count, 0)  # fmt: skip
    assert done.error_file_id is None
    assert all(getattr(done, f"{s}_at") for s in ("in_progress", "finalizing", "completed"))
    out = read_lines(openai_client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    by_id = {o["custom_id"]: o for o in out}
    for line in lines[:3]:  # greedy, float32: the batch's answer is the request's alone
        alone = openai_client.post(endpoint.removeprefix("/v1"), body=line["body"], cast_to=object)
        answer = by_id[line["custom_id"]]
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        body = answer["response"]["body"]
        assert answer["response"]["request_id"] == body["id"]
        assert body["choices"] == alone["choices"]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens differ
        assert [body["usage"][k] for k in counts] == [alone["usage"][k] for k in counts]


def test_lines_whose_results_redis_lost_run_again_before_the_batch_ends(
    openai_client, float32_pipeline
):
    # A Redis started again from its append-only file (fsynced every second) can come back
    # without the last results written before it died. Lost here by hand, mid-batch: the
    # runner finds those lines without a result once every line has run, and runs them
    # again, so the batch still answers every line once.
    from batch_store.batches import BatchStore

    lines = [completion_line(i) for i in range(24)]
    batch = submit(openai_client, lines, COMPLETIONS)
    store = BatchStore(redis.Redis.from_url(float32_pipeline.redis_url), float32_pipeline.config)
    out = store.key(batch.id, "out")
    deadline = time.monotonic() + 120
    while len(store.client.hkeys(out)) < 4:
        assert time.monotonic() < deadline, "no results"
        time.sleep(0.02)
    lost = store.client.hkeys(out)[:2]
    store.client.hdel(out, *lost)
    done = wait(openai_client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (24, 24)
    answered = [o["custom_id"] for o in read_lines(openai_client, done.output_file_id)]
    assert sorted(answered) == sorted(line["custom_id"] for line in lines)


def test_what_no_batch_wrote_in_the_runners_set_leaves_it_and_batches_run_on(
    openai_client, float32_pipeline
):
    # Anyone can write to Redis: a member that is not UTF-8 once ended the runner's polls
    # (no batch of that replica ran again); an id with no batch object, or one holding no
    # batch, failed again at every lease, for ever.
    from batch_store.batches import BatchStore

    store = BatchStore(redis.Redis.from_url(float32_pipeline.redis_url), float32_pipeline.config)
    store.client.set(store.key("junk"), b"[1, 2]")
    store.client.sadd(store.active, b"\xff\xfe", "gone", "junk")
    batch = submit(openai_client, [completion_line(i) for i in range(3)], COMPLETIONS)
    done = wait(openai_client, batch.id)
    assert done.status == "completed", done
    deadline = time.monotonic() + 10
    while store.client.smembers(store.active) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.client.smembers(store.active) == set()


def test_bad_lines_go_to_the_error_file_and_the_batch_goes_on(openai_client):
    bad_temperature = chat_line(2)
    bad_temperature["body"]["temperature"] = -1
    wrong_url = chat_line(3)
    wrong_url["url"] = COMPLETIONS
    lines = [chat_line(1), "{not json", {"method": "POST", "url": CHAT, "body": {}},
             wrong_url, chat_line(1), bad_temperature, chat_line(4)]  # fmt: skip
    done = wait(openai_client, submit(openai_client, lines, CHAT).id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (7, 2, 5)  # fmt: skip
    assert sorted(o["custom_id"] for o in read_lines(openai_client, done.output_file_id)) == [
        "chat-1", "chat-4"]  # fmt: skip
    errors = read_lines(openai_client, done.error_file_id)
    codes = sorted((e["custom_id"] or "", (e["error"] or {}).get("code")) for e in errors)
    assert codes == [("", "invalid_json"), ("", "missing_custom_id"),
                     ("chat-1", "duplicate_custom_id"), ("chat-2", None),
                     ("chat-3", "mismatched_url")]  # fmt: skip
    (refused,) = [e for e in errors if e["custom_id"] == "chat-2"]
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"


def test_a_cancelled_batch_stops_and_reports_what_finished(openai_client):
    lines = [chat_line(i, max_tokens=200) for i in range(200)]
    batch = submit(openai_client, lines, CHAT)
    deadline = time.monotonic() + 120
    while openai_client.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.25)
    cancelling = openai_client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait(openai_client, batch.id, timeout_s=60)
    assert done.status == "cancelled" and done.cancelled_at
    finished = done.request_counts.completed
    assert 1 <= finished < 200
    out = read_lines(openai_client, done.output_file_id)
    assert len(out) == finished == len({o["custom_id"] for o in out})
    with pytest.raises(openai.BadRequestError, match="status cancelled"):
        openai_client.batches.cancel(batch.id)
    # Nothing of it runs on: the next request is served at once.
    started = time.monotonic()
    openai_client.chat.completions.create(model=MODEL, max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert time.monotonic() - started < 15


def test_the_errors_a_user_can_make_are_4xx_saying_which_field(openai_client):
    good = openai_client.files.create(file=("a.jsonl", jsonl([chat_line(1)])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        openai_client.files.create(file=("a.jsonl", jsonl([chat_line(1)])), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        openai_client.batches.create(input_file_id="file-nope", endpoint=CHAT,
                                     completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        openai_client.batches.create(input_file_id=good.id, endpoint="/v1/embeddings",
                                     completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        openai_client.batches.create(
            input_file_id=good.id,
            endpoint=CHAT,
            completion_window="1h",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError):
        openai_client.batches.retrieve("batch_nope")
    empty = openai_client.files.create(file=("e.jsonl", b"\n\n"), purpose="batch")
    failed = wait(openai_client, openai_client.batches.create(
        input_file_id=empty.id, endpoint=CHAT, completion_window="24h").id)  # fmt: skip
    assert failed.status == "failed" and failed.errors.data[0].code == "invalid_file"


def test_batches_are_listed_newest_first_and_page(openai_client):
    made = [submit(openai_client, [chat_line(i)], CHAT).id for i in range(3)]
    listed = [b.id for b in openai_client.batches.list(limit=100)]
    assert [b for b in listed if b in made] == made[::-1]
    first = openai_client.batches.list(limit=1)
    assert first.has_more and len(first.data) == 1
    for batch_id in made:
        wait(openai_client, batch_id)


def test_priority_is_a_request_field_checked_like_the_others(openai_client):
    messages = [{"role": "user", "content": "Hi"}]
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"priority": -5}
    )
    assert answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.UnprocessableEntityError, match="priority"):
        openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"priority": "high"}
        )
