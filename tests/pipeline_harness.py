"""A whole running system for end-to-end tests (and the chaos benchmarks): `streamserve up`
as a child process.

Each harness has its own embedded Redis-protocol server (tests that flush the shared one
must not wipe a running pipeline) and its own free port; `streamserve up` is pointed at
them, so the launcher, every stage and the worker are the real processes users run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import redis

from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis
from stages.router.stage import live_workers

READY_TIMEOUT_S = 300.0

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
        """/health answers 200 with one live worker; wait for all of them."""
        client = redis.Redis.from_url(self.redis_url)
        workers = int(self.replicas.get("workers", 1))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"streamserve up exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200 and len(live_workers(client, self.config)) >= workers:
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
