"""Child processes that their parent stops, in its own order.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group. Children in that
group would all stop at once, the embedded Redis server among them, so the stages still
running log "Redis unreachable" and a worker cannot say goodbye. A child started with
`owned_child` has a session of its own, so only its parent hears the terminal, and stops its
children in the order it chooses (`streamserve up`: the stages, then the server). On Linux
the child also gets SIGTERM when its parent dies, so a parent that is killed outright
(SIGKILL, a crash) leaves no orphan serving on. Linux sends it when the *thread* that started
the child ends, so start an owned child from a thread that outlives it (the main thread, as
`streamserve up` and EmbeddedRedis's users do). The function run between fork and exec takes
no lock, so it is safe beside other threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def owned_child() -> dict[str, Any]:
    """Keyword arguments for `subprocess.Popen`: a new session, ended with its parent."""
    if _libc is None:
        return {"start_new_session": True}
    parent = os.getpid()

    def end_with_parent() -> None:  # runs in the child between fork and exec
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return {"start_new_session": True, "preexec_fn": end_with_parent}
