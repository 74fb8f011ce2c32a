"""Every benchmark script starts: CI runs no benchmark, so a move that breaks one's imports
would otherwise go unseen until someone measures."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("bench_*.py"))


def test_the_benchmarks_are_found():
    assert "bench_engine.py" in SCRIPTS and "bench_peers.py" in SCRIPTS


# Each script run as `python bench_x.py --help` would run it, all in one interpreter: a
# process each paid torch's import twenty times over (~1.5 s a script).
_RUN_EACH_HELP = """
import contextlib, io, json, runpy, sys, traceback
folder, scripts = sys.argv[1], sys.argv[2:]
sys.path.insert(0, folder)
results = {}
for script in scripts:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    code, error = 0, ""
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(f"{folder}/{script}", run_name="__main__")
    except SystemExit as exc:
        code = exc.code or 0
    except BaseException:
        code, error = 1, traceback.format_exc()
    results[script] = {"code": code, "stdout": out.getvalue(), "error": error}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, "-c", _RUN_EACH_HELP, str(BENCHMARKS), *SCRIPTS],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_imports_and_prints_its_help(script, helps):
    result = helps[script]
    assert result["code"] == 0, result["error"][-2000:]
    assert "usage" in result["stdout"]


def test_the_bus_load_benchmark_measures_a_short_run_of_synthetic_workers(tmp_path):
    out = tmp_path / "load.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_bus_load.py"), "--workers", "1",
         "--clients", "4", "--max-tokens", "16", "--warm-up", "1", "--seconds", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["benchmark"] == "bus-load" and row["tokens"] > 0 and row["client_errors"] == 0
    assert row["redis_commands_per_token"] > 0 and row["redis_cpu_us_per_token"] > 0
    assert {"ingress", "tokenizer", "router", "detokenizer", "worker", "clients"} <= set(
        row["cpu_us_per_token"]
    )
    table = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bus_capacity.py"), str(out)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "| Redis shard |" in table and "| ingress |" in table


@pytest.mark.parametrize("relay", [False, True])
def test_the_http_floor_benchmark_measures_a_bare_servers_cpu_a_request(tmp_path, relay):
    out = tmp_path / "floor.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_http_floor.py"), "--writes", "3",
         "--interval-ms", "10", "--clients", "8", "--warm-up", "0.5", "--seconds", "2",
         "--out", str(out), *(["--relay"] if relay else [])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["benchmark"] == "http-floor" and row["relay"] is relay and row["writes"] == 3
    assert row["requests"] > 0 and row["server_us_per_request"] > 0


def test_the_prefill_profile_splits_a_prefill_into_matmuls_kernels_and_the_rest(tmp_path):
    out = tmp_path / "profile.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_prefill_profile.py"), "--model",
         "random:smollm2-135m", "--dtype", "float32", "--workload", "single", "--rounds", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["benchmark"] == "prefill-profile" and row["prompt_tokens"] == 128
    parts = {k: v for k, v in row.items() if k.endswith("_s") and k not in
             ("wall_s", "outside_matmuls_s")}  # fmt: skip
    assert row["matmuls_s"] > 0 and row["attention_s"] > 0 and row["rest_s"] >= 0
    # The parts are disjoint: with the rest they make up the wall time.
    assert sum(parts.values()) == pytest.approx(row["wall_s"], abs=0.01)
    assert row["outside_matmuls_s"] == pytest.approx(row["wall_s"] - row["matmuls_s"], abs=0.01)


def test_the_bus_load_benchmark_runs_on_a_redis_cluster_of_two_shards(tmp_path):
    out = tmp_path / "load.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_bus_load.py"), "--shards", "2",
         "--workers", "1", "--clients", "4", "--max-tokens", "16", "--warm-up", "2",
         "--seconds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert (row["shards"], row["client_errors"]) == (2, 0) and row["tokens"] > 0
    assert 0 < row["redis_cores_busiest_shard"] <= row["redis_cores"]


def test_capacity_is_tokens_per_core_and_workers_per_core():
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks.bus_capacity import capacity

    figures = capacity({"redis": 20.0, "ingress": 8.0}, worker_tok_s=5000)
    redis = {"cpu_us_per_token": 20.0, "tok_s_per_core": 50000, "workers_per_core": 10.0}
    assert figures["per_core"]["redis"] == {**redis, "within_target": False}
    assert figures["per_core"]["ingress"]["tok_s_per_core"] == 125000
    assert figures["per_core"]["ingress"]["within_target"]


def test_the_kv_routing_benchmark_starts_a_workload_only_once_every_worker_beats_idle(
    redis_client, redis_url, monkeypatch
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run: its sibling scripts import
    from benchmarks.bench_kv_routing import wait_for_idle_workers
    from jobs.protocol import Heartbeat, encode
    from runtime.config import BusConfig

    config = BusConfig(redis_url=redis_url)

    def beat(worker_id: str, running: int) -> None:
        heartbeat = Heartbeat(worker_id, config.worker_stream(worker_id), "m", running, 0,
                              1_000, 1_000, 0, time.time())  # fmt: skip
        redis_client.set(config.heartbeat_key(worker_id), encode(heartbeat), px=5_000)
        redis_client.sadd(config.workers_key(), worker_id)

    waiter = threading.Thread(target=wait_for_idle_workers, args=(redis_client, config, 2))
    beat("w1", 0)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # the second worker is still loading
    beat("w2", 1)
    time.sleep(0.3)
    assert waiter.is_alive()  # it beats, but its last beat still counts a job running
    beat("w2", 0)
    waiter.join(timeout=5)
    assert not waiter.is_alive()
