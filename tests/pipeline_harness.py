"""A whole running system for end-to-end tests (and the chaos benchmarks): `streamserve up`
as a child process.

Each harness has its own embedded Redis-protocol server (tests that flush the shared one
must not wipe a running pipeline) and its own free port; `streamserve up` is pointed at
them, so the launcher, every stage and the worker are the real processes users run.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import redis

from jobs.protocol import ProtocolError, TokenizedRequest, decode, job_payloads
from runtime.cluster import shard_configs
from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis
from stages.router.stage import live_workers

READY_TIMEOUT_S = 300.0

# A blocked read's timeout fires on the server's clock tick (``hz``, 10 by default): a test's
# BLOCK of 5 ms took 100. The stages' own reads block for a second, where a 100 ms tick does
# not matter; the tests' short waits add up, so their servers tick at 100 Hz.
TEST_SERVER_HZ = 100


def tick_fast(redis_url: str) -> None:
    """Set a test's server to tick at TEST_SERVER_HZ."""
    with redis.Redis.from_url(redis_url) as client:
        client.config_set("hz", TEST_SERVER_HZ)


# Drafts verified whatever this machine's step costs say: the tests check what speculation
# does, not whether it pays here (on an AVX2-only host in float32 it does not).
SPECULATIVE_WORKER = ["--dtype=float32", "--speculative=ngram", "--speculative-verify=always"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Short claim and heartbeat times keep the tests quick to notice a dead replica.
QUICK_RECOVERY_ENV = {
    "STREAMSERVE_HEARTBEAT_INTERVAL_S": "0.5",
    "STREAMSERVE_HEARTBEAT_TTL_S": "2",
    "STREAMSERVE_CLAIM_IDLE_MS": "1000",
}


class Pipeline:
    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        env: dict[str, str] | None = None,
        redis_url: str | None = None,
        **replicas: Any,
    ) -> None:
        self.model = model
        self.env = QUICK_RECOVERY_ENV if env is None else env  # {}: the defaults users get
        self.replicas = replicas  # e.g. tokenizers=2, workers=2, worker_arg=[...]
        # A caller's server (redis_url) is the caller's to stop; otherwise a private one.
        self.server = EmbeddedRedis() if redis_url is None else None
        self._redis_url = redis_url
        self.process: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return self.server.url if self.server is not None else self._redis_url

    @property
    def config(self) -> BusConfig:
        return BusConfig(redis_url=self.redis_url)

    def start(self) -> Pipeline:
        if self.server is not None:
            self.server.start()
            tick_fast(self.server.url)
        command = [
            sys.executable, "-m", "cli", "up", "--model", self.model,
            "--redis-url", self.redis_url, "--port", str(self.port),
            "--log-level", "WARNING",
        ]  # fmt: skip
        for name, value in self.replicas.items():
            if name == "worker_arg":
                command += [f"--worker-arg={arg}" for arg in value]
            else:
                command += [f"--{name}", str(value)]
        env = {**os.environ, **self.env}
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
        self._wait_until_healthy()
        return self

    def _wait_until_healthy(self) -> None:
        """/health answers 200 with one live worker; wait for all of them (on a Redis
        Cluster, on every shard)."""
        shards = [(redis.Redis.from_url(s.redis_url), s) for s in shard_configs(self.config)]
        workers = int(self.replicas.get("workers", 1))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"streamserve up exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200 and all(
                        len(live_workers(client, config)) >= workers for client, config in shards
                    ):
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the pipeline was not healthy within {READY_TIMEOUT_S} s")

    def replica_pids(self, needle: str) -> list[int]:
        """Pids of the replicas `streamserve up` runs whose command line contains `needle`
        (e.g. "gpu_worker", "stage tokenizer")."""
        assert self.process is not None
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    command = cmdline.read().replace(b"\0", b" ").decode()
            except OSError:
                continue  # gone meanwhile
            if parent == self.process.pid and needle in command:
                pids.append(int(entry))
        return sorted(pids)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def post_on_new_connection(
    pipeline: Pipeline, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> http.client.HTTPResponse:
    """A POST on a connection of its own (behind SO_REUSEPORT: to any ingress replica)."""
    connection = http.client.HTTPConnection("127.0.0.1", pipeline.port, timeout=120)
    connection.request("POST", path, json.dumps(body),
                       {"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    return connection.getresponse()


def sse_events(response: http.client.HTTPResponse) -> Iterator[tuple[str | None, str]]:
    """(id, data) of each server-sent event until the stream ends (or breaks)."""
    event: dict[str, str] = {}
    while True:
        try:
            line = response.readline()
        except (http.client.HTTPException, OSError):
            return
        if not line:
            return
        line = line.decode().rstrip("\n")
        if line:
            key, _, value = line.partition(": ")
            event[key] = value
        elif event:
            yield event.get("id"), event["data"]
            event = {}


def resume_stream(
    pipeline: Pipeline, path: str, body: dict[str, Any], last_event_id: str, timeout_s: float = 60
) -> http.client.HTTPResponse:
    """The stream resumed after `last_event_id` once a replica can (its killed ingress's
    liveness key expired; until then: connection refused, or 409)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "could not resume"
        try:
            response = post_on_new_connection(pipeline, path, body,
                                              {"Last-Event-ID": last_event_id})  # fmt: skip
        except OSError:
            time.sleep(0.5)
            continue
        if response.status == 200:
            return response
        assert response.status == 409, response.read()
        response.read()
        time.sleep(0.5)


def stream_then_kill_its_ingress(
    pipeline: Pipeline, path: str, body: dict[str, Any], after_chars: int = 20
) -> tuple[str, str]:
    """Stream a completion until it has `after_chars` of text, then kill -9 the ingress
    replica serving it (named in the event ids); the text and the last event id."""
    text, last_id, killed = "", None, False
    resumable = {"X-Resumable-Stream": "true"}  # events carry ids only when asked
    for event_id, data in sse_events(post_on_new_connection(pipeline, path, body, resumable)):
        assert not killed, "the stream went on after its ingress was killed"
        text += json.loads(data)["choices"][0]["text"]
        last_id = event_id
        if len(text) > after_chars:
            frontend = event_id.split("/")[1]  # ingress-<host>-<pid>-<random>
            os.kill(int(frontend.rsplit("-", 2)[1]), signal.SIGKILL)
            killed = True
    assert killed and last_id is not None, "the stream ended before the kill"
    return text, last_id


def worker_holding(client: redis.Redis, config: BusConfig, rid: str) -> str:
    """The id of the registered worker that holds job `rid` (pending on its stream). Nothing
    records where a job went (an abort is a flag its worker reads: bus/aborts.py)."""
    for member in sorted(client.smembers(config.workers_key())):
        worker_id = member.decode()
        stream = config.worker_stream(worker_id)
        pending = {p["message_id"] for p in client.xpending_range(stream, "worker", "-", "+", 1000)}
        for entry_id, fields in client.xrange(stream):
            if entry_id in pending and rid in _rids_of(fields):
                return worker_id
    raise LookupError(f"no worker holds {rid}")


def _rids_of(fields: dict[bytes, bytes]) -> set[str]:
    """The rids of the jobs an entry holds: one, or a router batch's bundle of them."""
    rids = set()
    for payload in job_payloads(fields):
        try:
            rids.add(decode(payload, TokenizedRequest).rid)
        except ProtocolError:  # an Abort, or not a job
            pass
    return rids
