"""`streamserve status` and the ingress's /status page against a running `streamserve up`
with two tokenizers: both show the replicas that run, and their numbers follow the requests
sent. The page is loaded in headless Chromium (Debian's `chromium` package), whose dumped DOM
is read through the page's `data-field` attributes; without Chromium that test is skipped.
"""

from __future__ import annotations

import html
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from observability.deployment_status import read_status
from tests.ingress_harness import RunningIngress
from tests.pipeline_harness import QUICK_RECOVERY_ENV, Pipeline, free_port

MODEL = "smollm2-135m-instruct"
STAGES = ["ingress", "tokenizer", "router", "detokenizer"]
REPLICAS = {"ingress": 1, "tokenizer": 2, "router": 1, "detokenizer": 1}
METRICS_INTERVAL_S = 0.5
SENT = 3
MAX_TOKENS = 4
# Metrics are published every METRICS_INTERVAL_S; this leaves room for a loaded machine.
SETTLE_S = 10.0
# Virtual time the page gets: its first read of status.json and a few refreshes.
PAGE_BUDGET_MS = 3000
FIELD = re.compile(r'data-field="([^"]*)"[^>]*>([^<]*)<')
DEPLOYMENT_ENV = ("REDIS_URL", "STREAMSERVE_URL", "STREAMSERVE_API_KEY")


@pytest.fixture(scope="module")
def pipeline() -> Iterator[Pipeline]:
    env = {**QUICK_RECOVERY_ENV, "STREAMSERVE_METRICS_INTERVAL_S": str(METRICS_INTERVAL_S)}
    with Pipeline(MODEL, env=env, tokenizers=REPLICAS["tokenizer"]) as running:
        yield running


def status_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", "status", *args]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def clean_env() -> dict[str, str]:
    """This process's environment without a deployment in it: the flags say which."""
    return {k: v for k, v in os.environ.items() if k not in DEPLOYMENT_ENV}


def run_status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(status_command(*args), capture_output=True, text=True, timeout=60,
                          env=clean_env())  # fmt: skip


def source_flags(pipeline: Pipeline, source: str) -> list[str]:
    return ["--redis-url", pipeline.redis_url] if source == "redis" else ["--url", pipeline.url]


def status_json(pipeline: Pipeline, source: str) -> dict[str, Any]:
    done = run_status(*source_flags(pipeline, source), "--once", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def read_from_redis(pipeline: Pipeline) -> dict[str, Any]:
    client = redis.Redis.from_url(pipeline.redis_url)
    try:
        return read_status(client, pipeline.config)
    finally:
        client.close()


def eventually(read: Callable[[], dict], done: Callable[[dict], bool]) -> dict[str, Any]:
    """The first status `done` accepts, or the last one read when SETTLE_S runs out (for the
    caller's assert to show)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        status = read()
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.25)


def settled(pipeline: Pipeline) -> dict[str, Any]:
    """The status once its totals stop moving: an earlier test's last requests may not be
    published yet."""
    last = read_from_redis(pipeline)
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        time.sleep(3 * METRICS_INTERVAL_S)
        status = read_from_redis(pipeline)
        if status["totals"] == last["totals"]:
            return status
        last = status
    pytest.fail(f"the totals never settled: {last['totals']}")


def send(pipeline: Pipeline, count: int) -> None:
    for i in range(count):
        status, body = pipeline.post("/v1/completions", {
            "model": MODEL, "prompt": f"Status check {i}:", "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
        })  # fmt: skip
        assert status == 200, body


def replica_counts(status: dict[str, Any]) -> dict[str, int]:
    return {stage["name"]: len(stage["replicas"]) for stage in status["stages"]}


def lags(status: dict[str, Any]) -> dict[str, int]:
    """Every stream's lag: each stage's input stream and each worker's."""
    stages = {stage["name"]: stage["lag"] for stage in status["stages"] if stage["stream"]}
    return stages | {worker["id"]: worker["lag"] for worker in status["workers"]}


def all_running(status: dict[str, Any]) -> bool:
    return replica_counts(status) == REPLICAS and len(status["workers"]) == 1


def done_and_drained(requests: float) -> Callable[[dict[str, Any]], bool]:
    """`requests` counted, and every stream read to its end."""
    return lambda s: s["totals"]["requests"] == requests and not any(lags(s).values())


@pytest.mark.slow
@pytest.mark.parametrize("source", ["redis", "url"])
def test_status_once_json_shows_the_replicas_running_and_follows_requests(pipeline, source):
    status = eventually(lambda: status_json(pipeline, source), all_running)
    assert [stage["name"] for stage in status["stages"]] == STAGES
    assert replica_counts(status) == REPLICAS
    assert [worker["model"] for worker in status["workers"]] == [MODEL]

    before = settled(pipeline)["totals"]
    send(pipeline, SENT)
    expected = before["requests"] + SENT
    status = eventually(lambda: status_json(pipeline, source), done_and_drained(expected))
    assert status["totals"]["requests"] == expected
    assert status["totals"]["generation_tokens"] == before["generation_tokens"] + SENT * MAX_TOKENS
    assert lags(status) == dict.fromkeys(lags(status), 0)
    # The router says why it routed each job; the worker what its prefix cache found.
    status = eventually(lambda: status_json(pipeline, source),
                        lambda s: sum(s["routing"].values()) >= SENT)  # fmt: skip
    assert sum(status["routing"].values()) >= SENT  # eventually() gives up without asserting
    assert set(status["routing"]) <= {"prefix", "load", "balance"}
    (worker,) = status["workers"]
    assert worker["prefix_hit_rate"] is not None
    assert worker["cached_tokens"] >= 0 and worker["expected_cached_tokens"] >= 0


@pytest.mark.slow
def test_status_once_draws_the_stages_workers_and_throughput(pipeline):
    done = run_status("--url", pipeline.url, "--once")
    assert done.returncode == 0, done.stderr
    worker_ids = [worker["id"] for worker in read_from_redis(pipeline)["workers"]]
    for expected in [*STAGES, *worker_ids, "req/s", "gen tok/s", "dead letters", "routing: "]:
        assert expected in done.stdout, (expected, done.stdout)


def test_status_without_a_deployment_to_read_exits_2_saying_what_to_give():
    done = run_status("--once")
    assert done.returncode == 2
    assert "--redis-url" in done.stderr and "--url" in done.stderr, done.stderr


@pytest.mark.parametrize("flag", ["--url", "--redis-url"])
def test_status_once_of_an_unreachable_deployment_exits_1_with_one_line(flag):
    port = free_port()  # nothing listens there
    address = f"http://127.0.0.1:{port}" if flag == "--url" else f"redis://127.0.0.1:{port}/0"
    done = run_status(flag, address, "--once")
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: ") and str(port) in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_live_view_shows_the_error_and_keeps_retrying_until_ctrl_c():
    hits = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            body = json.dumps({"error": {"message": "Redis is down", "type": "x", "param": None,
                                         "code": "redis_unavailable"}}).encode()  # fmt: skip
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    # Ctrl-C as a terminal sends it: a test run started in the background of a shell without
    # job control ignores SIGINT, and its children would inherit that and never see it.
    live = subprocess.Popen(status_command("--url", url, "--interval", "0.2"), env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)  # fmt: skip
    try:
        deadline = time.monotonic() + SETTLE_S
        while len(hits) < 3 and time.monotonic() < deadline and live.poll() is None:
            time.sleep(0.1)
        live.send_signal(signal.SIGINT)
        out, err = live.communicate(timeout=10)
    finally:
        live.kill()
        server.shutdown()
    assert live.returncode == 0, err
    assert len(hits) >= 3 and set(hits) == {"/status.json"}, hits
    assert "503" in out and "Redis is down" in out and "retrying" in out, out


@pytest.mark.slow
def test_the_ingress_serves_the_page_as_html_and_the_status_as_json(pipeline):
    with urllib.request.urlopen(pipeline.url + "/status", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/html")
        assert "status.json" in reply.read().decode()
    with urllib.request.urlopen(pipeline.url + "/status.json", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("application/json")
        status = json.loads(reply.read())
    assert [stage["name"] for stage in status["stages"]] == STAGES
    assert replica_counts(status) == REPLICAS
    assert [worker["model"] for worker in status["workers"]] == [MODEL]


@pytest.fixture
def keyed_ingress(redis_client, redis_url) -> Iterator[RunningIngress]:
    with RunningIngress(redis_url, api_keys=("key-one",)) as ingress:
        yield ingress


def test_the_status_page_and_its_json_need_no_api_key(keyed_ingress):
    for path in ("/status", "/status.json"):
        status, _, _ = keyed_ingress.request("GET", path)
        assert status == 200, path
    assert keyed_ingress.request("GET", "/v1/models")[0] == 401  # the key is still wanted


def test_status_json_is_a_503_with_an_openai_body_while_redis_cannot_be_read(keyed_ingress):
    state = keyed_ingress.state
    working = state.sync_redis
    # No retries: redis-py's default backoff would only slow the 503 down.
    state.sync_redis = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    try:
        status, _, body = keyed_ingress.request("GET", "/status.json")
    finally:
        state.sync_redis.close()
        state.sync_redis = working
    assert status == 503
    assert json.loads(body)["error"]["code"] == "redis_unavailable"


@pytest.fixture
def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium to load /status in: apt-get install chromium (Debian's package)")


def page_fields(chromium: str, url: str) -> dict[str, str]:
    """The page's `data-field` numbers once it has read status.json, by field."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", f"--user-data-dir={profile}",
             f"--virtual-time-budget={PAGE_BUDGET_MS}", "--dump-dom", url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert "data-updated=" in done.stdout, f"the page never read status.json: {done.stderr}"
    return {html.unescape(field): html.unescape(text) for field, text in FIELD.findall(done.stdout)}


def page_workers(fields: dict[str, str]) -> list[str]:
    start, end = "workers.", ".running"
    return [f[len(start) : -len(end)] for f in fields if f.startswith(start) and f.endswith(end)]


@pytest.mark.slow
def test_the_status_page_in_chromium_follows_the_running_system(chromium, pipeline):
    before = settled(pipeline)
    page = page_fields(chromium, pipeline.url + "/status")
    assert {name: int(page[f"stages.{name}.replicas"]) for name in STAGES} == REPLICAS
    assert page_workers(page) == [worker["id"] for worker in before["workers"]]
    assert float(page["totals.requests"]) == before["totals"]["requests"]

    send(pipeline, SENT)
    expected = before["totals"]["requests"] + SENT
    eventually(lambda: read_from_redis(pipeline), done_and_drained(expected))
    page = page_fields(chromium, pipeline.url + "/status")
    assert float(page["totals.requests"]) == expected
    assert float(page["totals.generation_tokens"]) == (
        before["totals"]["generation_tokens"] + SENT * MAX_TOKENS
    )
    page_lags = {field: text for field, text in page.items() if field.endswith(".lag")}
    assert len(page_lags) == len(STAGES) - 1 + len(before["workers"])  # ingress reads no stream
    assert set(page_lags.values()) == {"0"}, page_lags
