"""`streamserve up` stops as a user stops it: a terminal's Ctrl-C or hangup, or the launcher
killed.

Ctrl-C and a closed terminal reach the terminal's whole process group. The stages must stop
before the embedded server they talk to (no "Redis unreachable", every worker says goodbye),
and a launcher killed outright must take its replicas and server with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

UP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Up:
    """`streamserve up` on a tiny random model, in a process group of its own as a shell
    runs a command, its output collected. Its embedded server persists, as users get it, but
    to `redis_data` rather than the user's own cache folder."""

    def __init__(self, redis_data: Path) -> None:
        env = {key: value for key, value in os.environ.items() if key != "REDIS_URL"}
        self.port = _free_port()
        command = [sys.executable, "-m", "cli", "up", "--model", "random:tiny-llama",
                   "--port", str(self.port), "--redis-data", str(redis_data)]  # fmt: skip
        self.process = subprocess.Popen(
            command, env=env, start_new_session=True, text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_until_up(self) -> None:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while "streamserve is up" not in self.output:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"streamserve up did not come up:\n{self.output[-3000:]}")
            time.sleep(0.2)

    def children(self) -> list[int]:
        """Pids of the launcher's children: every replica and the embedded server."""
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == self.process.pid:
                pids.append(int(entry))
        return pids

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# SIGINT: a terminal's Ctrl-C; SIGHUP: the terminal closed. Both reach its whole group.
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hangup"])
def test_a_terminal_stops_the_stages_before_the_embedded_server(signum, tmp_path):
    up = _Up(tmp_path / "redis")
    try:
        up.wait_until_up()
        os.killpg(up.process.pid, signum)
        assert up.process.wait(timeout=STOP_TIMEOUT_S) == 0
    finally:
        up.kill()
    up._reader.join(timeout=5)
    output = up.output
    assert "Redis unreachable" not in output, output[-3000:]
    assert "could not say goodbye" not in output, output[-3000:]
    assert "embedded server pid" in output and output.rstrip().endswith("stopped"), output[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_launcher_killed_outright_leaves_no_replica_or_server_behind(tmp_path):
    up = _Up(tmp_path / "redis")
    children: list[int] = []
    try:
        up.wait_until_up()
        children = up.children()
        assert len(children) >= 6  # the server, four CPU stages and a worker
        up.process.kill()  # SIGKILL to the launcher alone: no chance to stop anything
        up.process.wait()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)]
    finally:  # without the parent-death signal they would outlive this test: end them
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.kill()
