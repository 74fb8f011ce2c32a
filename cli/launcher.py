"""`streamserve up`: the whole system on one machine, each stage replica its own process.

With no Redis URL it starts the embedded server (runtime/embedded_server.py) first, keeping its
append-only file in ``--redis-data`` (default: the cache folder's ``redis/``) unless
``--no-redis-persistence``; a server that dies is started again on the same socket from that
file, and the stages reconnect to it by themselves (bus/reconnect.py). It waits
until ``/health`` answers and every worker has loaded its model and beats, prints where the API
listens, and on Ctrl-C or SIGTERM stops the stages (ingress first, so no new request comes
in, the workers last) and then the server. Each replica and the server run in a session of
their own (runtime/child_process.py): a terminal's Ctrl-C reaches only this process, which stops
them in that order, rather than every process at once. A replica that dies once the system is up is
started again (its work was picked up by its peers meanwhile: a dead worker's jobs move to
live workers, a dead CPU stage's pending entries are claimed); one that dies
more than ``RESTART_LIMIT`` times within ``RESTART_WINDOW_S``, or before the system is up, stops
everything with a non-zero exit: a crash loop that looks healthy is worse than no system.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import redis

from bus.access import BusAccessError, check_access, redacted
from bus.liveness import read_liveness
from cli.worker_command import worker_command
from runtime.child_process import owned_child
from runtime.cluster import shard_configs
from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis, EmbeddedServerError, default_data_dir

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
POLL_S = 0.25
RESTART_LIMIT = 5
RESTART_WINDOW_S = 60.0
# Loading a large append-only file takes a while; the server answers LOADING meanwhile.
SERVER_START_TIMEOUT_S = 120.0


@dataclass
class Replica:
    label: str
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    restarts: list[float] = field(default_factory=list)  # monotonic times


class Launcher:
    def __init__(self, args: argparse.Namespace, config: BusConfig) -> None:
        self.args = args
        self.config = config
        self.replicas: list[Replica] = []
        self.stop = threading.Event()
        self.server: EmbeddedRedis | None = None
        self.server_restarts: list[float] = []  # monotonic times
        self.shards: list[BusConfig] = [config]  # a Redis Cluster's: one pipeline on each

    def run(self) -> int:
        # SIGHUP: the terminal closed. The replicas, in sessions of their own, do not get it.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda *_: self.stop.set())
        try:
            if self.config.redis_url is not None:
                if self.args.redis_data is not None or self.args.no_redis_persistence:
                    logger.warning("--redis-data and --no-redis-persistence are for the "
                                   "embedded server: ignored with a Redis URL")  # fmt: skip
                try:
                    self.shards = shard_configs(self.config)
                    for shard in self.shards:
                        check_access(redis.Redis.from_url(shard.redis_url), shard)
                except BusAccessError as exc:
                    logger.error("%s", exc)  # once, rather than from every replica
                    return 2
                if len(self.shards) > 1:
                    logger.info(
                        "a Redis Cluster of %d shards: one pipeline on each (%s)",
                        len(self.shards),
                        ", ".join(s.shard or "" for s in self.shards),
                    )
            try:
                url = self.config.redis_url or self._start_embedded_server()
            except EmbeddedServerError as exc:
                logger.error("%s", exc)
                return 2
            self._start_stages(url)
            if not self._wait_until_healthy() or not self._wait_for_workers(url):
                return 1
            self._announce(url)
            return self._supervise()
        finally:
            self._stop_all()

    def _start_embedded_server(self) -> str:
        a = self.args
        data_dir = None if a.no_redis_persistence else (a.redis_data or default_data_dir())
        self.server = EmbeddedRedis(
            start_timeout_s=SERVER_START_TIMEOUT_S,
            data_dir=data_dir,
            # The default dir taken by another `up`: a private one, so this one still starts
            # and survives a crash of its server. A dir the user named: refuse, rather than
            # keep their data somewhere they did not ask for.
            if_locked="error" if a.redis_data is not None else "private",
            maxmemory=self.config.redis_maxmemory,
        )
        url = self.server.start()
        where = self.server.data_dir or "nowhere (no persistence)"
        logger.info("embedded Redis-protocol server at %s, data in %s", url, where)
        return url

    def _keep_server_up(self) -> bool:
        """Start a dead embedded server again, as `_restart` does a replica; False to stop."""
        if self.server is None or (code := self.server.poll()) is None:
            return True
        now = time.monotonic()
        self.server_restarts = [t for t in self.server_restarts if now - t < RESTART_WINDOW_S]
        self.server_restarts.append(now)
        if len(self.server_restarts) > RESTART_LIMIT:
            logger.error("the embedded server exited with code %d, %d times in %g s; "
                         "stopping everything", code, len(self.server_restarts),
                         RESTART_WINDOW_S)  # fmt: skip
            return False
        try:
            self.server.revive()  # same socket, so the stages' URL stays right
        except EmbeddedServerError as exc:
            logger.error("the embedded server exited with code %d and did not start again: %s",
                         code, exc)  # fmt: skip
            return False
        source = self.server.data_dir or "nothing: it is empty"
        logger.warning("the embedded server exited with code %d; started again (pid %d) from %s",
                       code, self.server.pid, source)  # fmt: skip
        return True

    def _start_stages(self, url: str) -> None:
        """Every replica asked for, on each shard: a shard's stages serve the requests its
        ingress replicas submit there (all listen on one port, SO_REUSEPORT spreading the
        connections) with its workers."""
        a = self.args
        # The URL goes in the environment, not argv, where `ps` would show its password.
        env = {**os.environ, "REDIS_URL": url}
        common = ["--model", a.model, "--log-level", a.log_level]
        workers = a.workers * len(self.shards)
        worker_env = dict(env)
        if workers > 1 and "OMP_NUM_THREADS" not in env:
            # Workers on a CPU share its cores: each taking all of them (torch's default)
            # oversubscribes the machine, and spinning threads then slow every step manyfold.
            cores = len(os.sched_getaffinity(0))
            worker_env["OMP_NUM_THREADS"] = str(max(1, cores // workers))
        stages = (
            ("worker", a.workers),  # first: loading the model is the slow part
            ("tokenizer", a.tokenizers),
            ("router", a.routers),
            ("detokenizer", a.detokenizers),
            ("ingress", a.ingress),
        )
        for name, count in stages:
            for shard in self.shards:
                on_shard = {} if len(self.shards) == 1 else {"STREAMSERVE_SHARD": shard.shard}
                for i in range(count):
                    label = f"{name}-{shard.shard}-{i}" if on_shard else f"{name}-{i}"
                    if name == "worker":
                        args = [*a.worker_arg, "--log-level", a.log_level]
                        if a.tp is not None:
                            args.append(f"--tp={a.tp}")
                        command = worker_command(None, a.model, args)
                        self._spawn(label, command, {**worker_env, **on_shard})
                        continue
                    command = [sys.executable, "-m", "cli", "stage", name, *common]
                    if name == "ingress":
                        command += ["--host", a.host, "--port", str(a.port),
                                    "--max-body-bytes", str(a.max_body_bytes),
                                    "--max-queue", str(a.max_queue)]  # fmt: skip
                    self._spawn(label, command, {**env, **on_shard})

    def _spawn(self, label: str, command: list[str], env: dict[str, str]) -> None:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, **owned_child())
        self.replicas.append(Replica(label, command, env, process))
        logger.info("started %s (pid %d)", label, process.pid)

    def _health_url(self) -> str:
        host = "127.0.0.1" if self.args.host in ("0.0.0.0", "::", "") else self.args.host
        return f"http://{host}:{self.args.port}"

    def _wait_until_healthy(self) -> bool:
        deadline = time.monotonic() + self.args.ready_timeout
        while not self.stop.is_set():
            if self._first_dead() is not None:
                return False
            try:
                with urllib.request.urlopen(self._health_url() + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or no worker yet (503)
            if time.monotonic() > deadline:
                logger.error("not healthy after %g s; stopping", self.args.ready_timeout)
                return False
            self.stop.wait(POLL_S)
        return False

    def _wait_for_workers(self, url: str) -> bool:
        """/health is 200 with one live worker; "up" means every worker started is live."""
        shards = [(redis.Redis.from_url(s.redis_url or url), s) for s in self.shards]
        deadline = time.monotonic() + self.args.ready_timeout
        try:
            while not self.stop.is_set():
                if self._first_dead() is not None or not self._keep_server_up():
                    return False
                try:
                    live = all(
                        len(read_liveness(c, s).beats) >= self.args.workers for c, s in shards
                    )
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # A Redis restart while the workers start: the stages ride it out, and
                    # so does this wait (it ended the whole system before).
                    logger.info("Redis unreachable while waiting for workers (%s)", exc)
                    live = False
                if live:
                    return True
                if time.monotonic() > deadline:
                    logger.error("fewer than %d workers live on each of %d shards after %g s; "
                                 "stopping", self.args.workers, len(shards),
                                 self.args.ready_timeout)  # fmt: skip
                    return False
                self.stop.wait(POLL_S)
            return False
        finally:
            for client, _ in shards:
                client.close()

    def _announce(self, url: str) -> None:
        base = self._health_url()
        auth = " -H 'Authorization: Bearer <key>'" if os.environ.get("STREAMSERVE_API_KEY") else ""
        print(
            f"\nstreamserve is up: {base}/v1  (model {self.args.model}, Redis {redacted(url)})\n"
            f"try:\n  curl {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' "
            f"""-d '{{"model": "{self.args.model}", "messages": """
            f"""[{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'\n"""
            "Ctrl-C stops everything.\n",
            flush=True,
        )

    def _supervise(self) -> int:
        while not self.stop.is_set():
            if not self._keep_server_up():
                return 1
            for replica in self.replicas:
                code = replica.process.poll()
                if code is not None and not self._restart(replica, code):
                    return 1
            self.stop.wait(POLL_S)
        return 0

    def _restart(self, replica: Replica, code: int) -> bool:
        now = time.monotonic()
        replica.restarts = [t for t in replica.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(replica.restarts) > RESTART_LIMIT:
            logger.error("%s exited with code %d, %d times in %g s; stopping everything",
                         replica.label, code, len(replica.restarts), RESTART_WINDOW_S)  # fmt: skip
            return False
        replica.process = subprocess.Popen(replica.command, env=replica.env,
                                           stdin=subprocess.DEVNULL, **owned_child())  # fmt: skip
        logger.warning("%s exited with code %d; started again (pid %d)",
                       replica.label, code, replica.process.pid)  # fmt: skip
        return True

    def _first_dead(self) -> str | None:
        for replica in self.replicas:
            code = replica.process.poll()
            if code is not None:
                logger.error("%s exited with code %d; stopping everything", replica.label, code)
                return replica.label
        return None

    def _stop_all(self) -> None:
        # Ingress first (no new requests), workers last.
        order = sorted(
            self.replicas,
            key=lambda r: (not r.label.startswith("ingress"), r.label.startswith("worker")),
        )
        for replica in order:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for replica in order:
            try:
                replica.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", replica.label)
                replica.process.kill()
                replica.process.wait()
        self.replicas.clear()
        if self.server is not None:
            self.server.stop()
            self.server = None
