"""docker-compose.yml's `cluster` profile, kept honest without a Docker engine: three
primaries in cluster mode, a one-shot service that makes them one cluster, and the stages
pointed at a node by STREAMSERVE_REDIS_URL alone. The end-to-end test runs the CPU stages'
and the CPU worker's own commands and environment, with that variable set, as local
processes on a cluster of the embedded binary, and gets a direct job answered on a shard."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis
import yaml

from bus.client import Client
from runtime.cluster import live_replicas, shard_configs
from runtime.config import BusConfig
from tests.cluster_fixture import running_cluster
from tests.test_compose import (
    COMPOSE_FILE,
    CPU_WORKER,
    ROOT,
    STAGES,
    environment_of,
    interpolate,
    local_process,
    log_tail,
    option,
    read_env_file,
    stop_all,
)

NODES = ("valkey-1", "valkey-2", "valkey-3")
CREATE = "cluster-create"
NODE_URL = "redis://valkey-1:6379"
READY_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def services():
    variables = {**read_env_file(), "STREAMSERVE_REDIS_URL": NODE_URL}
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), variables)["services"]


def test_the_cluster_profile_has_three_primaries_in_cluster_mode_each_on_its_own_volume(
    services,
):
    plain = services["redis"]["command"]
    volumes = set()
    for name in NODES:
        node = services[name]
        command = node["command"]
        assert node["profiles"] == ["cluster"], name
        assert option(command, "--cluster-enabled") == "yes", name
        assert option(command, "--cluster-announce-hostname") == name  # its service name
        assert option(command, "--cluster-config-file").startswith(option(command, "--dir"))
        for flag in ("--appendonly", "--appendfsync", "--maxmemory", "--maxmemory-policy"):
            assert option(command, flag) == option(plain, flag), (name, flag)
        [volume] = node["volumes"]
        source, _, target = volume.partition(":")
        assert target == option(command, "--dir")
        volumes.add(source)
    assert len(volumes) == len(NODES)


def test_the_cluster_is_made_once_after_every_node_is_healthy(services):
    create = services[CREATE]
    assert create["profiles"] == ["cluster"] and create["restart"] == "no"
    assert {n: d["condition"] for n, d in create["depends_on"].items()} == dict.fromkeys(
        NODES, "service_healthy"
    )
    script = create["command"][-1]
    assert "--cluster create" in script and "--cluster-replicas 0" in script
    assert all(f"getent hosts {name}" in script for name in NODES)


def test_stages_reach_the_cluster_through_one_variable_and_default_to_plain_redis(services):
    plain = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), read_env_file())["services"]
    for name in (*STAGES, CPU_WORKER):
        assert environment_of(services[name])["REDIS_URL"] == NODE_URL, name
        assert environment_of(plain[name])["REDIS_URL"] == "redis://redis:6379/0", name


@pytest.mark.slow
def test_the_cpu_stages_and_worker_services_serve_a_job_on_a_cluster_shard(services, tmp_path):
    processes: dict[str, subprocess.Popen] = {}
    with running_cluster(tmp_path / "cluster") as nodes:
        try:
            for name in ("tokenizer", "router", "detokenizer", CPU_WORKER):
                command, env = local_process(services[name], nodes[1], [])
                with open(tmp_path / f"{name}.log", "wb") as log:
                    processes[name] = subprocess.Popen(
                        command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT,
                    )  # fmt: skip
            home = shard_configs(BusConfig(redis_url=nodes[1]))[0]
            deadline = time.monotonic() + READY_TIMEOUT_S
            while live_replicas(home, "worker") < 1:
                exited = {n: p.returncode for n, p in processes.items() if p.poll() is not None}
                assert not exited, {n: log_tail(tmp_path / f"{n}.log") for n in exited}
                assert time.monotonic() < deadline, "the worker did not start"
                time.sleep(0.25)
            with Client(config=home) as client:
                result = client.generate(
                    messages=[{"role": "user", "content": "What is the capital of France?"}],
                    sampling={"max_new_tokens": 8, "temperature": 0},
                )
            assert result["text"].strip() and result["finish_reason"] in ("length", "stop")
            for node in nodes[1:]:
                with redis.Redis.from_url(node) as other:
                    assert other.dbsize() == 0  # every process attached to the home shard
            stop_all(processes)
            unclean = {n: p.returncode for n, p in processes.items() if p.returncode != 0}
            assert not unclean, {n: log_tail(tmp_path / f"{n}.log") for n in unclean}
        finally:
            stop_all(processes)
