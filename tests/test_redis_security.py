"""Redis with an ACL user, a password and TLS: the URL carries them to every process, and
credentials that cannot work stop each process at once with a message that says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from bus.client import Client
from runtime.embedded_server import EmbeddedRedis
from tests.pipeline_harness import Pipeline
from tests.tls_proxy import TlsProxy

PASSWORD = "s3cret-pw"
PREFIX_ONLY = ("~streamserve:*", "resetchannels", "+@all", "-@dangerous")

# Every kind of process a user starts against an external Redis.
COMMANDS = {
    "tokenizer": ["-m", "cli", "stage", "tokenizer"],
    "ingress": ["-m", "cli", "stage", "ingress", "--port", "0"],
    "worker": ["-m", "cli", "worker", "--model", "random:tiny-llama"],
    "up": ["-m", "cli", "up", "--model", "random:tiny-llama"],
}


@pytest.fixture(scope="module")
def acl_server():
    """Only the user `streamserve`, limited to the bus's keys; the default user is off."""
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "streamserve", "on", f">{PASSWORD}", *PREFIX_ONLY)
        admin.execute_command("ACL", "SETUSER", "elsewhere", "on", f">{PASSWORD}",
                              "~other:*", "+@all")  # fmt: skip
        admin.execute_command("ACL", "SETUSER", "default", "off")
        admin.close()
        yield server


def socket_of(server: EmbeddedRedis) -> str:
    return server.url.removeprefix("unix://")


def run(name: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *COMMANDS[name], "--redis-url", url],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_default_user_is_refused(acl_server):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(acl_server.url).ping()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_wrong_password_stops_the_process_with_a_clear_error(acl_server, name):
    result = run(name, f"unix://streamserve:wrong-pw@{socket_of(acl_server)}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "refused the credentials" in result.stderr
    assert "wrong-pw" not in result.stderr  # the URL is logged without its password


def test_a_user_without_the_bus_keys_is_told_what_it_needs(acl_server):
    result = run("tokenizer", f"unix://elsewhere:{PASSWORD}@{socket_of(acl_server)}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "may not use the bus" in result.stderr
    assert "~streamserve:*" in result.stderr
    assert PASSWORD not in result.stderr


@pytest.mark.slow
def test_the_system_serves_over_tls_as_an_acl_user(acl_server, tmp_path: Path, capfd):
    """Every stage and the worker on `rediss://` with a CA file, as a user limited to the
    bus's keys and without the dangerous commands: the bus needs nothing more."""
    with TlsProxy(Path(socket_of(acl_server)), tmp_path) as proxy:
        url = (f"rediss://streamserve:{PASSWORD}@localhost:{proxy.port}/0"
               f"?ssl_ca_certs={proxy.ca_file}")  # fmt: skip
        with pytest.raises(redis.ConnectionError):  # TLS without trusting the CA
            redis.Redis.from_url(url.split("?")[0]).ping()
        with Pipeline(redis_url=url, worker_arg=["--dtype=float32"]) as pipeline:
            status, body = pipeline.post("/v1/completions", {
                "model": pipeline.model, "prompt": "The capital of France is",
                "max_tokens": 8, "temperature": 0,
            })  # fmt: skip
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 8
            with Client(url) as client:  # direct Redis jobs take the same URL
                result = client.generate(
                    "The capital of France is", sampling={"max_new_tokens": 8, "temperature": 0}
                )
            assert result["text"] == body["choices"][0]["text"]
            replicas = pipeline.replica_pids("-m")
            assert len(replicas) == 5
            for pid in replicas:  # `up` hands the URL on in the environment, not argv
                assert PASSWORD not in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    printed = capfd.readouterr()
    assert "streamserve is up" in printed.out
    assert PASSWORD not in printed.out + printed.err
