"""How long each process takes to exit after SIGTERM while it waits for work: every CPU
stage and a worker started alone against an embedded server, then `streamserve up`
whole. One JSON line per process.

    python benchmarks/bench_stop_time.py [--model smollm2-135m-instruct] [--idle 12] [--out F]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jsonl import emit, machine  # noqa: E402

from cli.worker_command import worker_command  # noqa: E402
from runtime.embedded_server import EmbeddedRedis  # noqa: E402
from tests.pipeline_harness import Pipeline  # noqa: E402

STAGES = ("tokenizer", "router", "detokenizer", "ingress")


def _exit_seconds(process: subprocess.Popen[bytes]) -> float:
    start = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    process.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--idle", type=float, default=12.0,
                        help="seconds each process runs (and loads) before the signal")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="also append the lines here")
    args = parser.parse_args()
    rows = []
    with EmbeddedRedis() as server:
        commands = {
            name: [
                sys.executable,
                "-m",
                "cli",
                "stage",
                name,
                "--model",
                args.model,
                "--redis-url",
                server.url,
            ]  # fmt: skip
            for name in STAGES
        }
        worker_args = ["--worker-id", "w-stop", "--dtype=float32"]
        commands["worker"] = worker_command(server.url, args.model, worker_args)
        processes = {name: subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                     for name, command in commands.items()}  # fmt: skip
        time.sleep(args.idle)
        for name, process in processes.items():
            rows.append({"process": name, "exit_s": round(_exit_seconds(process), 3),
                         "code": process.returncode})  # fmt: skip
    up = Pipeline(args.model, worker_arg=["--dtype=float32"], env={}).start()
    time.sleep(2)
    assert up.process is not None
    rows.append({"process": "streamserve up", "exit_s": round(_exit_seconds(up.process), 3),
                 "code": up.process.returncode})  # fmt: skip
    up.stop()
    for row in rows:
        emit({"benchmark": "stop-time", "model": args.model, **row, **machine()}, args.out)


if __name__ == "__main__":
    main()
