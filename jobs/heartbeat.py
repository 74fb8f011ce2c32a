"""`Heartbeat`: a worker's load and what it serves, under its heartbeat key with a TTL.

Not a stream entry: each worker writes its own key every ``heartbeat_interval_s``
(gpu_worker/heartbeat.py), and the routers read them all (bus/liveness.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.wire import BOOL, FLOAT, INT, STR, Message


@dataclass
class Heartbeat(Message):
    """A worker's load, stored under its heartbeat key with a TTL (not on a stream)."""

    KIND = "heartbeat"
    FIELDS = {
        "worker_id": STR, "stream": STR, "model": STR, "running": INT, "waiting": INT,
        "free_kv_tokens": INT, "total_kv_tokens": INT, "admitted": INT, "time": FLOAT,
        "attention": STR, "weights_version": STR, "weights_target": STR, "weights_error": STR,
        "reads_bundles": BOOL,
    }  # fmt: skip
    # Workers from before they were added leave them out.
    OPTIONAL = frozenset({"attention", "weights_version", "weights_target", "weights_error",
                          "reads_bundles"})  # fmt: skip

    worker_id: str
    stream: str
    model: str
    running: int
    waiting: int
    free_kv_tokens: int
    total_kv_tokens: int
    admitted: int  # jobs read from its stream since it started
    time: float
    # What serves attention, e.g. "flashinfer (self-check passed: ...), CUDA graphs"
    attention: str | None = None
    # The weights it serves (jobs/weights.py), the version it is draining for and loading
    # (None: not updating), and why its last update failed ("<version>: <reason>").
    weights_version: str | None = None
    weights_target: str | None = None
    weights_error: str | None = None
    # It reads bundle entries of jobs on its stream (jobs/wire.py): a router sends it one per
    # batch, not one entry per job (stages/router/stage.py). Older workers leave it out.
    reads_bundles: bool = False
