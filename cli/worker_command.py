"""The command lines that start gpu_worker's entry points: by module name, in a child Python,
so that nothing on the CPU side imports gpu_worker. `streamserve worker` and `gpu-check` exec
them (cli/main.py), `streamserve up` spawns one per worker (cli/launcher.py)."""

from __future__ import annotations

import sys

WORKER_MODULE = "gpu_worker"  # started by name: stages never import gpu_worker
GPU_CHECK_MODULE = "gpu_worker.gpu_check"


def worker_command(redis_url: str | None, model: str, extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", WORKER_MODULE, "--model", model]
    if redis_url:
        command += ["--redis-url", redis_url]
    return command + extra
