"""The embedded server's append-only file: what it keeps through a kill -9 of the server, the
lock that keeps two servers off one data dir, and `streamserve up` starting its dead server
again from that file; and docker-compose.yml's Redis options, on a real server.

Real servers, real kills. Every write is followed by a 1.5 s wait before a kill: with
`appendfsync everysec` the server promises to lose at most about the last second of writes,
so a kill sooner could lose the write and the test would check luck, not the promise.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from runtime.embedded_server import LOCK_NAME, DataDirLockedError, EmbeddedRedis, find_server_binary
from tests.test_compose import COMPOSE_FILE, interpolate, read_env_file
from tests.test_launcher_stop import STOP_TIMEOUT_S, _Up

FSYNC_WINDOW_S = 1.5  # past appendfsync everysec's second
RECOVERY_TIMEOUT_S = 30.0


def _write_some_bus_state(client: redis.Redis) -> None:
    """A stream with a consumer group and an entry pending in it, as a stage leaves them, and
    a plain key."""
    client.xadd("t:jobs", {"m": "job-1"})
    client.xgroup_create("t:jobs", "stage", id="0")
    client.xreadgroup("stage", "replica-1", {"t:jobs": ">"})
    client.set("t:progress", "kept")


def _assert_bus_state(client: redis.Redis) -> None:
    assert [fields for _, fields in client.xrange("t:jobs")] == [{b"m": b"job-1"}]
    pending = client.xpending("t:jobs", "stage")
    assert (pending["pending"], pending["consumers"][0]["name"]) == (1, b"replica-1")
    assert client.get("t:progress") == b"kept"


def test_stream_groups_and_keys_survive_a_kill_9_of_the_server(tmp_path):
    data = tmp_path / "redis"
    with EmbeddedRedis(data_dir=data) as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        _write_some_bus_state(client)
        time.sleep(FSYNC_WINDOW_S)
        server.kill()  # SIGKILL: no chance to flush anything more
        client.close()
    assert (data / "appendonlydir").is_dir()

    with EmbeddedRedis(data_dir=data) as again:
        client = redis.Redis.from_url(again.url)
        _assert_bus_state(client)
        client.close()


def test_revive_after_a_crash_loads_the_file_on_the_same_socket(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path / "redis") as server:
        url, client = server.url, redis.Redis.from_url(server.url)
        _write_some_bus_state(client)
        time.sleep(FSYNC_WINDOW_S)
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while server.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert server.poll() == -signal.SIGKILL
        server.revive()
        assert server.url == url
        _assert_bus_state(client)  # the same client: it reconnects to the same socket
        client.close()


def test_a_second_server_on_a_taken_data_dir_gets_a_private_one(tmp_path, caplog):
    data = tmp_path / "redis"
    with caplog.at_level(logging.WARNING, logger="runtime.embedded_server"):
        with EmbeddedRedis(data_dir=data) as first, EmbeddedRedis(data_dir=data) as second:
            assert first.data_dir == data
            private = second.data_dir
            assert private is not None and private.parent == second.socket_dir
            assert f"{data} is in use (by process {os.getpid()})" in caplog.text
            a, b = redis.Redis.from_url(first.url), redis.Redis.from_url(second.url)
            a.set("k", "first")
            b.set("k", "second")
            assert (a.get("k"), b.get("k")) == (b"first", b"second")
            assert b.config_get("dir") == {"dir": str(private)}
            a.close()
            b.close()

            refused = EmbeddedRedis(data_dir=data, if_locked="error")
            with pytest.raises(DataDirLockedError, match="in use"):
                refused.start()
            assert refused.pid is None and refused.socket_dir is None  # nothing left behind
    assert not private.exists()  # a private dir goes with its server

    # Released at stop, and the first server's writes kept (a stop flushes the file).
    with EmbeddedRedis(data_dir=data, if_locked="error") as third:
        assert third.data_dir == data
        assert redis.Redis.from_url(third.url).get("k") == b"first"


def test_the_lock_is_held_until_the_server_of_a_killed_owner_is_gone_too(tmp_path):
    import fcntl

    data = tmp_path / "redis"
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from runtime.embedded_server import EmbeddedRedis\n"
         f"server = EmbeddedRedis(data_dir={str(data)!r}); server.start()\n"
         "print(server.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    server_pid = int(owner.stdout.readline())
    try:
        # Stopped, the server cannot act on the SIGTERM its owner's death sends it: it
        # stands for a server still writing its file after its owner is gone.
        os.kill(server_pid, signal.SIGSTOP)
        owner.kill()
        owner.wait()
        with open(data / LOCK_NAME) as lock:
            with pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.kill(server_pid, signal.SIGCONT)  # it ends on the pending SIGTERM
            deadline = time.monotonic() + 10
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the lock outlived the server"
                    time.sleep(0.05)
    finally:
        owner.stdout.close()
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        try:
            os.kill(server_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _compose_redis_options() -> list[str]:
    compose = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), read_env_file())
    _, *options = compose["services"]["redis"]["command"]
    at = options.index("--dir")
    del options[at : at + 2]  # the server changes to its dir as it reads it: /data is not here
    return options


def _started(command: list[str], client: redis.Redis, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        assert process.poll() is None, log.read_text(errors="replace")
        try:
            client.ping()
            return process
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "the server did not answer PING"
            time.sleep(0.05)


def test_the_compose_files_redis_keeps_its_data_through_a_kill_9():
    """docker-compose.yml's Redis options given to the embedded server's binary (valkey reads
    Redis 7's options), only where it listens and writes changed: a misspelt option would stop
    the container's Redis, a wrong one lose its data."""
    with tempfile.TemporaryDirectory(prefix="streamserve-") as folder:  # a short socket path
        socket_path, log = Path(folder) / "redis.sock", Path(folder) / "server.log"
        command = [str(find_server_binary()), *_compose_redis_options(), "--port", "0",
                   "--unixsocket", str(socket_path), "--dir", folder]  # fmt: skip
        client = redis.Redis(unix_socket_path=str(socket_path))
        process = _started(command, client, log)
        try:
            settings = client.config_get("*")
            assert (settings["appendonly"], settings["appendfsync"]) == ("yes", "everysec")
            assert settings["save"] == ""
            # Bounded, and full means "refuse writes", never "evict a job's keys".
            assert (int(settings["maxmemory"]), settings["maxmemory-policy"]) == (
                2**30,
                "noeviction",
            )
            _write_some_bus_state(client)
            time.sleep(FSYNC_WINDOW_S)
            process.kill()
            process.wait()
            process = _started(command, client, log)
            _assert_bus_state(client)
        finally:
            client.close()
            process.terminate()
            process.wait(timeout=10)


def _server_pid(up: _Up) -> int | None:
    """The pid of the launcher's valkey-server child, if one runs (by its program name: the
    server rewrites its command line)."""
    for pid in up.children():
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() == "valkey-server":
                    return pid
        except OSError:
            continue
    return None


def _socket_path(up: _Up) -> str:
    found = re.search(r"Redis unix://(\S+)\)", up.output)
    assert found is not None, up.output[-3000:]
    return found.group(1)


def _generate(up: _Up) -> int:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    request = urllib.request.Request(f"http://127.0.0.1:{up.port}/generate",
                                     data=json.dumps(body).encode())  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert len(json.loads(reply.read())["output_ids"]) == 4
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0  # the ingress not answering at all


def test_streamserve_up_restarts_its_killed_server_from_the_file(tmp_path):
    up = _Up(tmp_path / "redis")
    try:
        up.wait_until_up()
        server_pid, socket_path = _server_pid(up), _socket_path(up)
        assert server_pid is not None, up.output[-3000:]
        client = redis.Redis(unix_socket_path=socket_path)
        client.set("t:kept", "yes")
        time.sleep(FSYNC_WINDOW_S)
        os.kill(server_pid, signal.SIGKILL)

        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while _generate(up) != 200:  # /generate needs every stage and the worker back
            assert up.process.poll() is None, up.output[-3000:]
            assert time.monotonic() < deadline, f"not serving again:\n{up.output[-3000:]}"
            time.sleep(0.25)
        assert _server_pid(up) not in (None, server_pid)
        assert client.get("t:kept") == b"yes"
        client.close()
        assert "embedded server exited with code" in up.output

        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(timeout=STOP_TIMEOUT_S) == 0
    finally:
        up.kill()
