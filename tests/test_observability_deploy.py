"""The `observability` profile's files, kept honest without Docker, Prometheus or Grafana.

docker-compose.yml's prometheus and grafana services, deploy/prometheus.yml, Grafana's
provisioning and the streamserve dashboard must agree with each other (the scrape target is
a service of the file, on the port it listens on; the dashboard's datasource is the one
provisioned) and with the metrics streamserve exports: every family a PromQL expression
names is one of KNOWN_FAMILIES, grouped and matched only by labels that family carries.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.test_compose import interpolate, read_env_file

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
NGINX_CONFIG = ROOT / "deploy" / "nginx.conf"
GRAFANA = ROOT / "deploy" / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "streamserve.yml"
DASHBOARD = GRAFANA / "dashboards" / "streamserve.json"

PROFILE = "observability"
PROMETHEUS_PORT = 9090  # what the prom/prometheus image listens on
GRAFANA_PORT = 3000  # what the grafana/grafana image listens on
JOB = "streamserve"

# Every process's series carry these two; the stream families, served for the deployment
# as a whole, carry neither.
PROCESS = frozenset({"role", "replica"})
ROLES = frozenset({"ingress", "tokenizer", "router", "detokenizer", "worker"})

# Each family streamserve exports, by its full name, with the labels its series carry
# (histograms: their `_bucket` series carry `le` as well).
FAMILY_LABELS: dict[str, frozenset[str]] = {
    f"streamserve:{name}": frozenset(labels)
    for name, labels in {
        # ingress
        "requests_total": PROCESS | {"endpoint", "status"},
        "requests_in_flight": PROCESS,
        "time_to_first_token_seconds": PROCESS,
        "inter_token_latency_seconds": PROCESS,
        "e2e_request_latency_seconds": PROCESS,
        "stream_resumes_total": PROCESS,
        "request_aborts_total": PROCESS,
        # worker
        "num_requests_running": PROCESS,
        "num_requests_waiting": PROCESS,
        "kv_cache_usage_perc": PROCESS,
        "prefix_cache_queries_total": PROCESS,
        "prefix_cache_hits_total": PROCESS,
        "prompt_tokens_total": PROCESS,
        "generation_tokens_total": PROCESS,
        "request_success_total": PROCESS | {"finished_reason"},
        "request_queue_time_seconds": PROCESS,
        "num_preemptions_total": PROCESS,
        "spec_decode_num_draft_tokens_total": PROCESS,
        "spec_decode_num_accepted_tokens_total": PROCESS,
        "worker_step_seconds": PROCESS | {"kind"},
        "worker_jobs_migrated_in_total": PROCESS,
        "worker_step_failures_total": PROCESS,
        "worker_info": PROCESS | {"attention", "graphs", "model", "cpu_kernels"},
        # router
        "worker_jobs_migrated_out_total": PROCESS | {"worker"},
        "router_decisions_total": PROCESS | {"reason"},
        "router_expected_cached_tokens_total": PROCESS | {"worker"},
        "router_routed_prompt_tokens_total": PROCESS | {"worker"},
        # every stage
        "stage_entries_total": PROCESS,
        "stage_batch_size": PROCESS,
        "stage_handle_seconds": PROCESS,
        "stage_dead_letters_total": PROCESS,
        "stage_claimed_entries_total": PROCESS,
        # the deployment's own: streams and live workers
        "live_workers": set(),
        "stream_length": {"stream"},
        "stream_group_lag": {"stream", "group"},
        "stream_group_pending": {"stream", "group"},
        "stream_group_consumers": {"stream", "group"},
        # the Redis server's own (observability/redis_server.py)
        "redis_commands_processed_total": set(),
        "redis_cpu_seconds_total": set(),
        "redis_ops_per_second": set(),
        "redis_memory_used_bytes": set(),
        "redis_maxmemory_bytes": set(),
        "redis_connected_clients": set(),
    }.items()
}
KNOWN_FAMILIES = frozenset(FAMILY_LABELS)
HISTOGRAMS = frozenset(
    f"streamserve:{name}"
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "worker_step_seconds",
        "stage_batch_size",
        "stage_handle_seconds",
    )
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# The rows the dashboard shows, in order.
ROWS = ["Overview", "Latency", "Workers", "Pipeline"]

_METRIC = re.compile(r"streamserve:[A-Za-z0-9_:]+")
_SELECTOR = re.compile(r"(streamserve:[A-Za-z0-9_:]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'\s*(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# ---- reading the files -------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = interpolate(load_yaml(COMPOSE_FILE), read_env_file())
    return compose["services"]


@pytest.fixture(scope="module")
def prometheus_config() -> dict[str, Any]:
    return load_yaml(PROMETHEUS_CONFIG)


@pytest.fixture(scope="module")
def datasource() -> dict[str, Any]:
    (only,) = load_yaml(DATASOURCES)["datasources"]
    return only


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host path, container path, mode) of each of a service's bind mounts."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source.startswith((".", "/")):
            mounts.append((source, target, mode[0] if mode else "rw"))
    return mounts


def published_port(service: dict[str, Any], container_port: int) -> str:
    (mapping,) = service["ports"]
    host, _, container = str(mapping).rpartition(":")
    assert container == str(container_port), mapping
    return host


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those of collapsed rows included, rows themselves left out."""
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            panels += panel.get("panels", [])
        else:
            panels.append(panel)
    return panels


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) of every query of the dashboard."""
    return [(panel["title"], t) for panel in all_panels(dashboard) for t in panel["targets"]]


def family_of(name: str) -> str:
    """The family a series name belongs to: a histogram's `_bucket/_sum/_count` stripped."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


def labels_of(name: str) -> frozenset[str]:
    labels = FAMILY_LABELS[family_of(name)]
    return labels | {"le"} if name.endswith("_bucket") else labels


# ---- docker-compose.yml ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["prometheus", "grafana"])
def test_prometheus_and_grafana_run_only_in_the_observability_profile(services, name):
    assert services[name]["profiles"] == [PROFILE]
    assert services[name]["restart"] == "unless-stopped"


@pytest.mark.parametrize("name", ["prometheus", "grafana"])
def test_their_bind_mounts_are_read_only_and_exist_in_the_repository(services, name):
    mounts = bind_mounts(services[name])
    assert mounts
    for source, target, mode in mounts:
        assert mode == "ro", (name, source)
        assert (ROOT / source).exists(), (name, source)
        assert target.startswith("/"), (name, target)


def test_prometheus_reads_deploy_prometheus_yml_and_publishes_its_port(services):
    prometheus = services["prometheus"]
    assert prometheus["image"].split(":")[0] == "prom/prometheus"
    targets = {target: ROOT / source for source, target, _ in bind_mounts(prometheus)}
    assert targets["/etc/prometheus/prometheus.yml"].resolve() == PROMETHEUS_CONFIG
    assert published_port(prometheus, PROMETHEUS_PORT) == str(PROMETHEUS_PORT)


def test_grafana_mounts_provisioning_and_dashboards_and_lets_anonymous_viewers_in(services):
    grafana = services["grafana"]
    assert grafana["image"].split(":")[0] == "grafana/grafana"
    targets = {target: (ROOT / source).resolve() for source, target, _ in bind_mounts(grafana)}
    assert targets["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    environment = {name: str(value) for name, value in grafana["environment"].items()}
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert environment.get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") == "Viewer"
    home = environment.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:  # a container path: the dashboard's, through a mount of its folder
        folder, _, file = home.rpartition("/")
        assert targets[folder] / file == DASHBOARD
    assert "prometheus" in grafana["depends_on"]
    assert published_port(grafana, GRAFANA_PORT) == str(GRAFANA_PORT)


def test_env_file_leaves_the_observability_profile_off(services):
    assert PROFILE not in read_env_file()["COMPOSE_PROFILES"].split(",")


def test_compose_header_says_how_to_start_the_profile():
    header = COMPOSE_FILE.read_text().partition("\nx-")[0]
    assert re.search(rf"COMPOSE_PROFILES=\S*\b{PROFILE}\b\S* docker compose up", header)


# ---- deploy/prometheus.yml ---------------------------------------------------------------


def test_prometheus_scrapes_one_job_every_5_s(prometheus_config):
    (job,) = prometheus_config["scrape_configs"]
    assert job["job_name"] == JOB
    assert job.get("metrics_path", "/metrics") == "/metrics"
    interval = job.get("scrape_interval", prometheus_config["global"]["scrape_interval"])
    assert interval == "5s"
    timeout = job.get("scrape_timeout", prometheus_config["global"].get("scrape_timeout"))
    # Prometheus refuses a timeout longer than the interval.
    assert timeout is None or int(timeout.removesuffix("s")) <= 5


def test_the_scrape_target_is_the_load_balancer_on_the_port_it_listens_on(
    services, prometheus_config
):
    (job,) = prometheus_config["scrape_configs"]
    (static,) = job["static_configs"]
    (target,) = static["targets"]
    host, _, port = target.partition(":")
    assert host in services, f"{target}: no such service in docker-compose.yml"
    assert "profiles" not in services[host]  # up whatever the profiles
    assert host in services["prometheus"].get("depends_on", [host])
    # The nginx config is the one the service mounts; it listens on the scraped port, and
    # its container side of the published port is the same.
    mounted = {t: ROOT / s for s, t, _ in bind_mounts(services[host])}
    config = mounted["/etc/nginx/conf.d/default.conf"].read_text()
    assert re.search(rf"^\s*listen {port};", config, re.MULTILINE)
    published_port(services[host], int(port))
    # ... and passes /metrics on to the ingress replicas.
    assert re.search(r"^\s*location / \{", config, re.MULTILINE)


# ---- Grafana provisioning ----------------------------------------------------------------


def test_datasource_is_the_prometheus_service_with_a_fixed_uid(services, datasource):
    assert datasource["type"] == "prometheus"
    assert datasource["uid"]
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus" and url.hostname in services
    assert url.port == PROMETHEUS_PORT
    assert datasource.get("access", "proxy") == "proxy"  # Grafana's server asks, not browsers


def test_dashboard_provider_loads_the_mounted_dashboard_folder(services):
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    mounts = {t: (ROOT / s).resolve() for s, t, _ in bind_mounts(services["grafana"])}
    folder = mounts[provider["options"]["path"].rstrip("/")]
    assert folder == DASHBOARD.parent
    assert sorted(folder.glob("*.json")) == [DASHBOARD]


# ---- the dashboard -----------------------------------------------------------------------


def test_dashboard_has_a_fixed_uid_a_recent_schema_and_the_four_rows(dashboard):
    assert dashboard["uid"] == "streamserve"
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert [p["title"] for p in dashboard["panels"] if p["type"] == "row"] == ROWS
    assert dashboard["panels"][0]["type"] == "row"


def test_panels_have_unique_ids_and_fit_the_grid(dashboard):
    panels = dashboard["panels"] + [
        p for row in dashboard["panels"] if row["type"] == "row" for p in row.get("panels", [])
    ]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]


def test_every_panel_is_a_timeseries_or_stat_with_a_query(dashboard):
    panels = all_panels(dashboard)
    assert len(panels) >= 20
    for panel in panels:
        assert panel["type"] in {"timeseries", "stat"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_panel_and_query_uses_the_provisioned_datasource(dashboard, datasource):
    expected = {"type": "prometheus", "uid": datasource["uid"]}
    for panel in all_panels(dashboard):
        assert panel["datasource"] == expected, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", expected) == expected, panel["title"]


def test_every_metric_a_query_names_is_a_known_family(dashboard):
    unknown = {
        (title, name)
        for title, target in expressions(dashboard)
        for name in _METRIC.findall(target["expr"])
        if family_of(name) not in KNOWN_FAMILIES
    }
    assert not unknown, f"metrics streamserve does not export: {sorted(unknown)}"


def test_every_query_names_a_streamserve_metric(dashboard):
    for title, target in expressions(dashboard):
        assert _METRIC.search(target["expr"]), (title, target["expr"])


def test_histograms_are_read_through_their_series_never_by_family_name(dashboard):
    for title, target in expressions(dashboard):
        for name in _METRIC.findall(target["expr"]):
            assert name not in HISTOGRAMS, (title, name)


def test_label_matchers_use_labels_the_family_has(dashboard):
    for title, target in expressions(dashboard):
        for name, matchers in _SELECTOR.findall(target["expr"]):
            for matcher in filter(None, matchers.split(",")):
                match = _MATCHER.fullmatch(matcher)
                assert match, (title, matcher)
                label, op, value = match.groups()
                assert label in labels_of(name), (title, name, label)
                if label == "role" and op == "=":
                    assert value in ROLES, (title, value)


def test_grouping_and_legends_use_labels_the_queried_families_have(dashboard):
    for title, target in expressions(dashboard):
        expr = target["expr"]
        available = frozenset().union(*(labels_of(n) for n in _METRIC.findall(expr)))
        for grouping in _GROUPING.findall(expr):
            labels = {label.strip() for label in grouping.split(",") if label.strip()}
            assert labels <= available, (title, labels - available)
        # A legend names labels the result keeps: those grouped by, when the query groups.
        kept = set(available)
        if _GROUPING.search(expr):
            kept = {
                label.strip() for grouping in _GROUPING.findall(expr)
                for label in grouping.split(",")
            }  # fmt: skip
        for label in _LEGEND_LABEL.findall(target.get("legendFormat", "")):
            assert label in kept, (title, label)


def test_quantiles_come_from_bucket_rates_summed_by_le(dashboard):
    found = 0
    for title, target in expressions(dashboard):
        expr = target["expr"]
        for call in re.finditer(r"histogram_quantile\(\s*([0-9.]+)\s*,", expr):
            found += 1
            assert 0 < float(call.group(1)) < 1, title
            rest = expr[call.end() :]
            grouping = _GROUPING.search(rest)
            grouped = {g.strip() for g in grouping.group(1).split(",")} if grouping else set()
            assert "le" in grouped, (title, expr)
            assert re.search(r"rate\(streamserve:\w+_bucket\[", rest), (title, expr)
    assert found >= 10


def test_queries_have_balanced_brackets(dashboard):
    pairs = {")": "(", "]": "[", "}": "{"}
    for title, target in expressions(dashboard):
        stack: list[str] = []
        for char in re.sub(r'"[^"]*"', '""', target["expr"]):
            if char in "([{":
                stack.append(char)
            elif char in pairs:
                assert stack and stack.pop() == pairs[char], (title, target["expr"])
        assert not stack, (title, target["expr"])


def test_the_dashboard_shows_every_family_but_none_it_does_not_know(dashboard):
    shown = {family_of(n) for _, t in expressions(dashboard) for n in _METRIC.findall(t["expr"])}
    assert shown == KNOWN_FAMILIES, f"families no panel shows: {sorted(KNOWN_FAMILIES - shown)}"
