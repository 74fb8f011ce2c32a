"""runtime/event_loop.py: which loop an asyncio process runs on, and a clear error for a bad
choice (the ingress's own runs, on uvloop, are every end-to-end test's)."""

import asyncio
import os
import subprocess
import sys

import pytest

from runtime import event_loop


def test_auto_is_uvloop_where_installed_and_asyncio_on_request():
    pytest.importorskip("uvloop")
    assert event_loop.loop_name({}) == "uvloop"
    assert event_loop.loop_name({event_loop.ENV: "auto"}) == "uvloop"
    assert event_loop.loop_name({event_loop.ENV: " AsyncIO "}) == "asyncio"


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="expected one of auto, uvloop, asyncio"):
        event_loop.loop_name({event_loop.ENV: "trio"})


def test_run_runs_the_coroutine_on_the_loop_chosen(monkeypatch):
    async def loop_type() -> str:
        return type(asyncio.get_running_loop()).__module__

    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.run(loop_type()).startswith("asyncio")
    if event_loop.loop_name({}) == "uvloop":
        monkeypatch.setenv(event_loop.ENV, "uvloop")
        assert event_loop.run(loop_type()).startswith("uvloop")


def test_the_cli_refuses_a_bad_choice_before_starting_anything():
    done = subprocess.run(
        [sys.executable, "-m", "cli", "stage", "ingress", "--redis-url", "redis://127.0.0.1:1"],
        env={**os.environ, event_loop.ENV: "bogus"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "STREAMSERVE_EVENT_LOOP='bogus'" in done.stderr
