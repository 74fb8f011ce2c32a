"""The Redis server's own figures on /metrics and `streamserve status`: how close the bus's
server is to its limits, read from its INFO (observability/redis_server.py); none, without
failing, where INFO is refused."""

from __future__ import annotations

import redis
from rich.console import Console

from cli.status import render
from observability.deployment_metrics import deployment_registry
from observability.deployment_metrics import render as render_metrics
from observability.deployment_status import read_status
from observability.redis_server import read_server_figures
from runtime.config import BusConfig
from tests.prometheus_text import total

FAMILIES = (
    "streamserve:redis_commands_processed_total", "streamserve:redis_cpu_seconds_total",
    "streamserve:redis_ops_per_second", "streamserve:redis_memory_used_bytes",
    "streamserve:redis_maxmemory_bytes", "streamserve:redis_connected_clients",
)  # fmt: skip


def _shown(status: dict) -> str:
    console = Console(width=200, record=True)
    console.print(render(status, "test"))
    return console.export_text()


def test_the_servers_figures_are_read_from_one_info(redis_client):
    before = read_server_figures(redis_client)
    redis_client.set("figures:probe", "x" * 10_000)
    after = read_server_figures(redis_client)
    assert after.commands_processed > before.commands_processed > 0
    assert after.memory_bytes > 0 and after.connected_clients >= 1
    assert after.cpu_seconds >= before.cpu_seconds > 0
    assert after.maxmemory_bytes == int(redis_client.config_get("maxmemory")["maxmemory"])


def test_metrics_and_status_show_the_server(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url)
    text = render_metrics(deployment_registry([(redis_client, config)], None)).decode()
    assert all(total(text, name) is not None for name in FAMILIES), text
    assert total(text, "streamserve:redis_commands_processed_total") > 0
    assert text.count("# TYPE streamserve:redis_cpu_seconds_total counter") == 1
    status = read_status(redis_client, config)
    assert status["redis"]["commands_processed"] > 0
    assert "ops/s" in _shown(status) and "clients" in _shown(status)


def test_a_user_refused_info_gets_no_server_figures_and_nothing_fails(redis_client, redis_url):
    redis_client.execute_command(
        "ACL", "SETUSER", "figures-noinfo", "on", ">pw", "~*", "&*", "+@all", "-info"
    )
    try:
        url = redis_url.replace("unix://", "unix://figures-noinfo:pw@", 1)
        refused = redis.Redis.from_url(url)
        assert read_server_figures(refused) is None
        config = BusConfig(redis_url=url)
        text = render_metrics(deployment_registry([(refused, config)], None)).decode()
        assert total(text, "streamserve:redis_commands_processed_total") is None
        assert total(text, "streamserve:live_workers") == 0  # the rest still served
        status = read_status(refused, config)
        assert status["redis"] is None
        assert "INFO refused" in _shown(status)
        refused.close()
    finally:
        redis_client.execute_command("ACL", "DELUSER", "figures-noinfo")
