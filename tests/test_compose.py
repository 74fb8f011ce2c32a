"""docker-compose.yml, kept honest without a Docker engine.

The structure checks read the file as Compose would (YAML anchors merged, ``${VAR:-default}``
filled from `.env` alone). The end-to-end test then runs every streamserve service's own
command and environment as a local process, only the addresses changed (Redis, the ingress
port, the cache volume), and asks the ingress for a chat completion.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.embedded_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_FILE = ROOT / ".env"
DOCKERFILE = ROOT / "Dockerfile"

STAGES = ("ingress", "tokenizer", "router", "detokenizer")
GPU_WORKER = "worker"
CPU_WORKER = "worker-cpu"
STREAMSERVE_SERVICES = (*STAGES, GPU_WORKER, CPU_WORKER)
LOAD_BALANCER = "nginx"
CACHE_VOLUME = "model-cache"
REDIS_VOLUME = "redis-data"
CACHE_USERS = ("tokenizer", "detokenizer", GPU_WORKER, CPU_WORKER)

# The image's entrypoint, as a local command: `streamserve` is the console script for
# cli:main (test_entrypoint_is_the_streamserve_console_script holds that).
LOCAL_ENTRYPOINTS = {"streamserve": [sys.executable, "-m", "cli"]}

READY_TIMEOUT_S = 180.0  # a cold cache converts the GGUF file first (~20 s); warm: seconds
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
LOG_TAIL_CHARS = 3000

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\})")


# ---- reading the file as Compose does ----------------------------------------------------


def read_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's ``$$``, ``${VAR}``, ``${VAR-default}`` and ``${VAR:-default}``."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group("name", "op", "default")
        if op == ":-" and not variables.get(name):
            return default
        if op == "-" and name not in variables:
            return default
        return variables.get(name, "")

    substituted = _VARIABLE.sub(substitute, value)
    leftover = _VARIABLE.sub("", value).replace("$$", "")
    assert "$" not in leftover, f"variable syntax this test does not read: {value!r}"
    return substituted


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # With no variable set in the shell, `.env` is all Compose fills the file from.
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), read_env_file())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict[str, Any]]:
    return compose["services"]


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.partition("=")[::2] for item in environment)
    return {name: str(value) for name, value in environment.items()}


def option(command: list[str], flag: str) -> str | None:
    """The last value given to `flag` (argparse keeps the last)."""
    values = [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == flag]
    return values[-1] if values else None


def entrypoint() -> list[str]:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            return json.loads(line.removeprefix("ENTRYPOINT"))
    raise AssertionError("the Dockerfile has no ENTRYPOINT")


def find_key(node: Any, key: str, path: str = "") -> list[str]:
    if isinstance(node, dict):
        found = [f"{path}.{key}"] if key in node else []
        return found + [p for k, v in node.items() for p in find_key(v, key, f"{path}.{k}")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in find_key(v, key, f"{path}[{i}]")]
    return []


# ---- structure ---------------------------------------------------------------------------


def test_every_stage_the_workers_redis_and_the_load_balancer_have_a_service(services):
    missing = {*STREAMSERVE_SERVICES, "redis", LOAD_BALANCER} - set(services)
    assert not missing, f"services missing from docker-compose.yml: {sorted(missing)}"


def test_no_service_fixes_its_container_name_so_every_service_scales(compose):
    assert find_key(compose, "container_name") == []


def test_streamserve_services_publish_no_host_port_so_replicas_do_not_collide(services):
    publishing = [name for name in STREAMSERVE_SERVICES if services[name].get("ports")]
    assert publishing == []


def test_load_balancer_alone_publishes_the_api_port(services):
    assert services[LOAD_BALANCER]["ports"] == ["8000:8000"]  # ${STREAMSERVE_PORT:-8000}


def test_redis_is_the_official_7_image_with_a_ping_healthcheck(services):
    redis = services["redis"]
    assert redis["image"] == "redis:7"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_redis_keeps_an_append_only_file_on_a_named_volume(compose, services):
    service = services["redis"]
    command = service["command"]
    assert command[0] == "redis-server"
    assert option(command, "--appendonly") == "yes"
    assert option(command, "--appendfsync") == "everysec"  # at most ~1 s lost to a crash
    volumes = service["volumes"]
    mounts = {target: source for source, _, target in (m.partition(":") for m in volumes)}
    assert mounts[option(command, "--dir")] == REDIS_VOLUME
    assert REDIS_VOLUME in compose["volumes"]  # named: it outlives the container
    # tests/test_redis_persistence.py gives these options to a real server.


def test_streamserve_services_wait_for_healthy_redis_restart_and_run_under_init(services):
    for name in STREAMSERVE_SERVICES:
        service = services[name]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert service["restart"] == "unless-stopped", name
        assert service["init"] is True, name
        environment = environment_of(service)
        assert environment["REDIS_URL"] == "redis://redis:6379/0", name
        assert environment["STREAMSERVE_MODEL"] == "smollm2-135m-instruct", name


def test_every_streamserve_service_is_built_from_the_one_dockerfile(services):
    for name in STREAMSERVE_SERVICES:
        build = services[name]["build"]
        assert (build["context"], build["dockerfile"]) == (".", "Dockerfile"), name
        assert set(build.get("args", {})) <= {"TORCH_INDEX_URL", "TORCH_VERSION", "EXTRAS"}, name
    assert DOCKERFILE.is_file()
    for arg in ("TORCH_INDEX_URL", "TORCH_VERSION", "EXTRAS"):
        assert re.search(rf"^ARG {arg}=", DOCKERFILE.read_text(), re.MULTILINE), arg


def test_entrypoint_is_the_streamserve_console_script():
    assert entrypoint() == ["streamserve"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.partition("[project.scripts]")[2].partition("\n[")[0]
    assert re.search(r'^streamserve = "cli:main"$', scripts, re.MULTILINE)


def test_services_use_the_images_entrypoint_with_their_own_command(services):
    for name in STREAMSERVE_SERVICES:
        assert "entrypoint" not in services[name], name
    for name in STAGES:
        assert services[name]["command"][:2] == ["stage", name]
    for name in (GPU_WORKER, CPU_WORKER):
        assert services[name]["command"][0] == "worker", name


def test_gpu_worker_reserves_an_nvidia_gpu_in_the_gpu_profile(services):
    worker = services[GPU_WORKER]
    assert worker["profiles"] == ["gpu"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert option(worker["command"], "--device") == "cuda"  # fail loudly, never fall back
    assert "pypi.org" in worker["build"]["args"]["TORCH_INDEX_URL"]  # a CUDA torch build
    assert worker["build"]["args"]["EXTRAS"] == "gpu"  # FlashInfer, from pyproject's extra
    extras = (ROOT / "pyproject.toml").read_text().partition("[project.optional-dependencies]")[2]
    assert re.search(r'^gpu = \["flashinfer-python==', extras, re.MULTILINE)


def test_cpu_worker_runs_on_cpu_in_the_cpu_profile_without_a_gpu(services):
    worker = services[CPU_WORKER]
    assert worker["profiles"] == ["cpu"]
    assert option(worker["command"], "--device") == "cpu"
    assert "deploy" not in worker
    assert "args" not in worker["build"]  # the Dockerfile's default: the CPU torch wheel


def test_stages_belong_to_no_profile_and_env_file_picks_the_gpu_worker(services):
    for name in (*STAGES, "redis", LOAD_BALANCER):
        assert "profiles" not in services[name], name
    assert read_env_file()["COMPOSE_PROFILES"] == "gpu"


def test_model_cache_volume_is_shared_by_tokenizer_detokenizer_and_workers(compose, services):
    assert CACHE_VOLUME in compose["volumes"]
    for name in CACHE_USERS:
        mounts = {
            target: source
            for source, _, target in (m.partition(":") for m in services[name]["volumes"])
        }
        cache_dir = environment_of(services[name])["STREAMSERVE_CACHE"]
        targets = [t for t, s in mounts.items() if s == CACHE_VOLUME]
        assert targets and cache_dir.startswith(targets[0].rstrip("/") + "/"), name


def test_load_balancer_config_finds_every_ingress_replica_through_docker_dns(services):
    lb = services[LOAD_BALANCER]
    sources = {target: source for source, target, *_ in (m.split(":") for m in lb["volumes"])}
    config = (ROOT / sources["/etc/nginx/conf.d/default.conf"]).read_text()
    ingress_port = option(services["ingress"]["command"], "--port")
    assert re.search(rf"http://ingress:{ingress_port}\b", config)
    assert re.search(r"^\s*resolver 127\.0\.0\.11\b", config, re.MULTILINE)
    assert re.search(r"^\s*proxy_buffering off;", config, re.MULTILINE)  # SSE
    # A literal `proxy_pass http://ingress` is resolved once at start-up: later replicas
    # would never get a request.
    assert re.search(r"^\s*proxy_pass \$\w+;", config, re.MULTILINE)


# ---- the services, run locally -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_cache_dir() -> str:
    """The host folder that stands for the model-cache volume: the tests' usual cache, so the
    default model is converted once per machine, not once per run."""
    return os.environ.get("STREAMSERVE_CACHE") or str(Path.home() / ".cache" / "streamserve")


def local_process(
    service: dict[str, Any], redis_url: str, extra_args: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `service`'s container, as a process on this machine."""
    program, *arguments = entrypoint()
    command = [*LOCAL_ENTRYPOINTS[program], *arguments, *service["command"]]
    # The host's own settings stay out: the service runs with what the compose file gives it.
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("STREAMSERVE_") and name != "REDIS_URL"
    }
    env.update(environment_of(service))
    env["REDIS_URL"] = redis_url
    if "STREAMSERVE_CACHE" in env:
        env["STREAMSERVE_CACHE"] = local_cache_dir()
    return command + extra_args, env


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def wait_until_healthy(url: str, processes: dict[str, subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, process in processes.items():
            if process.poll() is not None:
                pytest.fail(
                    f"service {name} exited with code {process.returncode} before the system "
                    f"was healthy; its log:\n{log_tail(logs / f'{name}.log')}"
                )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or no worker beating yet (503)
        time.sleep(0.25)
    pytest.fail(f"GET /health was not 200 within {READY_TIMEOUT_S} s")


def stop_all(processes: dict[str, subprocess.Popen]) -> None:
    # SIGTERM to every service at once, as `docker compose stop` sends it; then SIGKILL.
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def post_json(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


@pytest.mark.slow
def test_compose_services_run_locally_answer_a_chat_and_stop_on_sigterm(services, tmp_path):
    port = free_port()
    order = (*STAGES, CPU_WORKER)
    processes: dict[str, subprocess.Popen] = {}
    # A server of its own: the shared `redis_url` fixture is flushed by other tests.
    with EmbeddedRedis() as redis_server:
        try:
            for name in order:
                extra = ["--port", str(port)] if name == "ingress" else []
                command, env = local_process(services[name], redis_server.url, extra)
                with open(tmp_path / f"{name}.log", "wb") as log:
                    processes[name] = subprocess.Popen(
                        command,
                        env=env,
                        cwd=ROOT,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
            url = f"http://127.0.0.1:{port}"
            wait_until_healthy(url, processes, tmp_path)
            status, body = post_json(
                url + "/v1/chat/completions",
                {
                    "model": environment_of(services["ingress"])["STREAMSERVE_MODEL"],
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 8,
                    "temperature": 0,
                },
            )
            assert status == 200, body
            assert body["choices"][0]["message"]["content"].strip(), body
            # `docker compose stop` sends SIGTERM: every service must end cleanly on it.
            stop_all(processes)
            unclean = {n: p.returncode for n, p in processes.items() if p.returncode != 0}
            assert not unclean, "".join(
                f"\n{n} exited with {code}:\n{log_tail(tmp_path / f'{n}.log')}"
                for n, code in unclean.items()
            )
        finally:
            stop_all(processes)
