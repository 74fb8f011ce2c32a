"""`streamserve batch` and `bus.client`'s batch methods against a running system: a batch
submitted through Redis and through an ingress, answered once per line; cancel; and the
errors a user sees (one line, the right exit code, never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bus.client import Client
from jobs.errors import RequestError

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"


def chat_line(i: int, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    return {"custom_id": f"chat-{i}", "method": "POST", "url": CHAT, "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # No source in the environment: each call names its own.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "STREAMSERVE_URL")}
    return subprocess.run([sys.executable, "-m", "cli", "batch", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def sources(float32_pipeline):
    return {"redis": ["--redis-url", float32_pipeline.redis_url],
            "ingress": ["--url", float32_pipeline.url]}  # fmt: skip


@pytest.mark.parametrize("via", ["redis", "ingress"])
def test_submit_wait_and_results_answer_each_line_once(sources, tmp_path, via):
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl([chat_line(i) for i in range(5)]))
    submitted = cli("submit", str(path), "--wait", "--interval", "0.2", *sources[via])
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.splitlines()[0]
    assert batch_id.startswith("batch_") and "status       completed" in submitted.stdout
    # Not a terminal: the progress is plain lines on stderr, the last one the end.
    last = submitted.stderr.splitlines()[-1]
    assert last == f"{batch_id} completed: 5/5 done (5 completed, 0 failed)"

    status = cli("status", batch_id, "--json", *sources[via])
    batch = json.loads(status.stdout)
    assert (batch["status"], batch["endpoint"], batch["request_counts"]) == (
        "completed", CHAT, {"total": 5, "completed": 5, "failed": 0})  # fmt: skip

    results = cli("results", batch_id, *sources[via])
    assert results.returncode == 0 and results.stderr == ""
    out = [json.loads(line) for line in results.stdout.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"chat-{i}" for i in range(5)]
    assert all(o["response"]["status_code"] == 200 for o in out)

    to_files = cli("results", batch_id, "--output", str(tmp_path / "out.jsonl"),
                   "--errors", str(tmp_path / "err.jsonl"), *sources[via])  # fmt: skip
    assert to_files.returncode == 0 and to_files.stdout == ""
    assert (tmp_path / "out.jsonl").read_text() == results.stdout
    assert (tmp_path / "err.jsonl").read_text() == ""


def test_cancel_ends_the_batch_cancelled(sources, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_bytes(jsonl([chat_line(i, max_tokens=64) for i in range(100)]))
    submitted = cli("submit", str(path), "--endpoint", CHAT, *sources["ingress"])
    batch_id = submitted.stdout.strip()
    cancelled = cli("cancel", batch_id, *sources["redis"])
    assert cancelled.returncode == 0 and cancelled.stdout.split() == [batch_id, "cancelling"]
    # --wait follows it to its end, and exits 1: it did not complete.
    waited = cli("status", batch_id, "--wait", "--interval", "0.2", "--json", *sources["redis"])
    assert waited.returncode == 1 and json.loads(waited.stdout)["status"] == "cancelled"
    again = cli("cancel", batch_id, *sources["ingress"])
    assert again.returncode == 1 and "status cancelled" in again.stderr
    assert again.stderr.count("\n") == 1


@pytest.mark.parametrize("via", ["redis", "ingress"])
def test_an_unknown_batch_is_one_line_and_exit_1(sources, via):
    shown = cli("status", "batch_nope", "--json", *sources[via])
    assert shown.returncode == 1 and shown.stdout == ""
    assert shown.stderr.count("\n") == 1 and "batch_nope" in shown.stderr


def test_unreachable_and_bad_arguments_are_one_line(tmp_path):
    for source in (["--redis-url", "redis://127.0.0.1:1"], ["--url", "http://127.0.0.1:1"]):
        listed = cli("list", *source)
        assert listed.returncode == 1 and listed.stderr.startswith("error: cannot reach")
        assert listed.stderr.count("\n") == 1
    missing = cli("submit", str(tmp_path / "missing.jsonl"), "--redis-url", "redis://127.0.0.1:1")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    (tmp_path / "no-url.jsonl").write_text('{"custom_id": "a", "body": {}}\n')
    unknown = cli("submit", str(tmp_path / "no-url.jsonl"), "--url", "http://127.0.0.1:1")
    assert unknown.returncode == 2 and "--endpoint" in unknown.stderr
    assert cli("status").returncode == 2  # argparse: no ID


def test_client_batch_methods_round_trip(float32_pipeline):
    with Client(float32_pipeline.redis_url) as client:
        upload = client.upload_batch_file(jsonl([chat_line(i) for i in range(3)]))
        assert (upload["object"], upload["purpose"]) == ("file", "batch")
        made = client.create_batch(upload["id"], CHAT, metadata={"run": "test"})
        assert made["status"] == "validating" and made["metadata"] == {"run": "test"}
        assert made["id"] in [b["id"] for b in client.list_batches(limit=100)["data"]]
        done = client.wait_batch(made["id"], timeout=60, poll_s=0.2)
        assert client.batch(made["id"]) == done and done["status"] == "completed"
        output, errors = client.batch_results(made["id"])
        assert sorted(o["custom_id"] for o in output) == ["chat-0", "chat-1", "chat-2"]
        assert errors == []
        with pytest.raises(RequestError, match="status completed"):
            client.cancel_batch(made["id"])
        with pytest.raises(RequestError) as unknown:
            client.batch("batch_nope")
        assert unknown.value.status == 404
