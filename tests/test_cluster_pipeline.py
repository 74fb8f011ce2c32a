"""The pipeline on one shard of a Redis Cluster (three primaries of the embedded binary):
tokenizer, router, detokenizer and workers started as users start them, with the URL of any
node and no flag saying it is a cluster; jobs put on the shard with `bus.client.Client`.
Greedy float32 tokens equal transformers', also when the worker running a job is killed
with SIGKILL mid-generation and the job moves to the shard's other worker. A stage whose
shard's slot moves to another primary (a reshard) exits with one line and code 3."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from bus.client import Client
from cli.worker_command import worker_command
from gpu_worker.hf_reference import hf_greedy
from runtime.cluster import EXIT_SHARD_MOVED, key_slot, shard_configs
from runtime.config import BusConfig
from stages.router.stage import live_workers
from tests.pipeline_harness import QUICK_RECOVERY_ENV, worker_holding

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CPU_STAGES = ("tokenizer", "router", "detokenizer")
READY_TIMEOUT_S = 300.0
PROMPT = [1, 504, 3458, 314, 4649, 282]


class ShardProcesses:
    """CPU stages and workers as child processes, each with its own log file."""

    def __init__(self, redis_url: str, log_dir: Path, env: dict[str, str]) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.env = {**os.environ, **QUICK_RECOVERY_ENV, **env}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start_stages(self) -> None:
        for name in CPU_STAGES:
            self.spawn(name, [sys.executable, "-m", "cli", "stage", name, "--model", MODEL,
                               "--redis-url", self.redis_url])  # fmt: skip

    def start_worker(self, worker_id: str, *options: str) -> None:
        extra = ["--worker-id", worker_id, *(options or ["--dtype=float32"])]
        self.spawn(worker_id, worker_command(self.redis_url, MODEL, extra))

    def spawn(self, name: str, command: list[str]) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                command, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def wait_for_workers(self, shard: BusConfig, count: int) -> None:
        client = redis.Redis.from_url(shard.redis_url)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(live_workers(client, shard)) < count:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    log = (self.log_dir / f"{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{log}")
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.25)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def processes_on(nodes, tmp_path):
    started: list[ShardProcesses] = []

    def start(redis_url: str, env: dict[str, str]) -> ShardProcesses:
        started.append(ShardProcesses(redis_url, tmp_path, env))
        return started[-1]

    yield start
    for processes in started:
        processes.stop()


def test_a_pipeline_started_with_any_nodes_url_runs_on_one_shard(
    nodes, processes_on, hf_default_model, default_tokenizer
):
    shards = shard_configs(BusConfig(redis_url=nodes[2]))
    processes = processes_on(nodes[2], {})  # not shard 0's node: every process finds its own
    processes.start_stages()
    processes.start_worker("w-home")
    processes.wait_for_workers(shards[0], 1)  # on an empty cluster, every role picks shard 0

    sampling = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Client(config=shards[0]) as client:
        by_ids = client.generate(input_ids=PROMPT, sampling=sampling)
        by_chat = client.generate(messages=[{"role": "user", "content": "Hi"}], sampling=sampling)
    [expected] = hf_greedy(hf_default_model, [PROMPT], max_new_tokens=12, stop_at_eos=False)
    assert by_ids["output_ids"] == expected
    assert by_ids["text"] == default_tokenizer.decode(expected)
    assert len(by_chat["output_ids"]) == 12 and by_chat["finish_reason"] == "length"
    for name in (*CPU_STAGES, "w-home"):
        assert f"attached to cluster shard {shards[0].shard}" in processes.log(name), name
    for node in nodes[1:]:  # nothing of the deployment anywhere else
        with redis.Redis.from_url(node) as other:
            assert other.dbsize() == 0


def test_workers_started_one_after_another_spread_over_the_shards(nodes, processes_on):
    shards = shard_configs(BusConfig(redis_url=nodes[1]))
    processes = processes_on(nodes[1], {})
    for index, shard in enumerate(shards):
        processes.start_worker(f"w{index}", "--synthetic")
        processes.wait_for_workers(shard, 1)
    processes.start_worker("w3", "--synthetic")
    processes.wait_for_workers(shards[0], 2)  # every shard had one: a tie, the first
    for index, shard in enumerate(shards):
        assert f"attached to cluster shard {shard.shard}" in processes.log(f"w{index}")


def test_a_job_whose_worker_is_killed_finishes_on_the_shards_other_worker(
    nodes, processes_on, hf_default_model
):
    shards = shard_configs(BusConfig(redis_url=nodes[0]))
    shard = shards[1]
    processes = processes_on(nodes[0], {"STREAMSERVE_SHARD": shard.shard})
    processes.start_stages()
    processes.start_worker("w-a")
    processes.start_worker("w-b")
    processes.wait_for_workers(shard, 2)

    max_new = 64
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    [expected] = hf_greedy(hf_default_model, [PROMPT], max_new_tokens=max_new, stop_at_eos=False)
    ids, killed = [], None
    with Client(config=shard) as client, redis.Redis.from_url(shard.redis_url) as bus:
        rid = client.submit(input_ids=PROMPT, sampling=sampling)
        for chunk in client.stream(rid, timeout=READY_TIMEOUT_S):
            ids += chunk["output_ids"]
            if killed is None and len(ids) >= 8:
                killed = worker_holding(bus, shard, rid)
                processes.processes[killed].send_signal(signal.SIGKILL)
                killed_at = len(ids)
    assert killed in ("w-a", "w-b") and killed_at < max_new
    assert ids == expected
    [survivor] = {"w-a", "w-b"} - {killed}
    assert processes.processes[survivor].poll() is None
    resumed = f"worker {survivor}: resuming {rid} after "
    assert resumed in processes.log(survivor)  # the kill landed mid-generation
    assert f"moved 1 jobs off {shard.worker_stream(killed)}" in processes.log("router")
    for node in (nodes[0], nodes[2]):
        with redis.Redis.from_url(node) as other:
            assert other.dbsize() == 0


def test_a_stage_whose_shard_slot_moves_to_another_primary_exits_saying_so(nodes, processes_on):
    shards = shard_configs(BusConfig(redis_url=nodes[0]))
    shard = shards[2]
    processes = processes_on(nodes[0], {"STREAMSERVE_SHARD": shard.shard})
    processes.spawn("router", [sys.executable, "-m", "cli", "stage", "router",
                                "--redis-url", nodes[0]])  # fmt: skip
    router = processes.processes["router"]
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "attached to cluster shard" not in processes.log("router"):
        assert router.poll() is None and time.monotonic() < deadline, processes.log("router")
        time.sleep(0.1)
    time.sleep(1.0)  # reading its stream
    _move_slot(key_slot(shard.key_prefix), source=nodes[2], target=nodes[1], every=nodes)
    assert router.wait(timeout=60) == EXIT_SHARD_MOVED
    assert f"router: shard {shard.shard} moved off" in processes.log("router")


def _move_slot(slot: int, source: str, target: str, every: list[str]) -> None:
    """A reshard of one slot, as valkey-cli does it: importing and migrating, the keys
    moved, then the slot given to the target on every node."""
    src, dst = redis.Redis.from_url(source), redis.Redis.from_url(target)
    src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    host, port = (
        dst.connection_pool.connection_kwargs["host"],
        dst.connection_pool.connection_kwargs["port"],
    )
    while True:
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", host, port, "", 0, 5000, "KEYS", *keys)
        try:
            for node in (target, source, *(u for u in every if u not in (source, target))):
                redis.Redis.from_url(node).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
            return
        except redis.ResponseError:
            continue  # a key written meanwhile: move it too
