"""A Redis Cluster of the embedded binary (valkey-server in cluster mode), for the tests
that run the bus on a cluster and benchmarks/bench_bus_load.py's ``--shards``:
`running_cluster(tmp_path)` yields its node URLs (three primaries unless asked otherwise).

Slots are assigned by hand (even shares: 0-5460, 5461-10922, 10923-16383 for three, as
`valkey-cli --cluster create` would) and the nodes introduced with CLUSTER MEET: no
replicas, nothing on disk but each node's cluster config file.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from runtime.embedded_server import find_server_binary
from tests.pipeline_harness import TEST_SERVER_HZ, free_port

SLOTS = 16384


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """The slots split evenly, as `valkey-cli --cluster create` splits them."""
    bounds = [round(i * SLOTS / primaries) for i in range(primaries + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(primaries)]


SLOT_RANGES = tuple(slot_ranges(3))  # (0, 5460), (5461, 10922), (10923, 16383)
READY_TIMEOUT_S = 30.0
BIND_ATTEMPTS = 5


@contextlib.contextmanager
def running_cluster(tmp_path: Path, primaries: int = 3) -> Iterator[list[str]]:
    """`primaries` nodes on 127.0.0.1, each owning an even share of the slots, until the
    block ends."""
    binary = str(find_server_binary())
    processes: list[subprocess.Popen[bytes]] = []
    clients: list[redis.Redis] = []
    ports: list[int] = []
    bus_ports: list[int] = []
    try:
        ranges = slot_ranges(primaries)
        for index in range(primaries):
            node_dir = tmp_path / f"node-{index}"
            node_dir.mkdir(parents=True, exist_ok=True)
            for attempt in range(BIND_ATTEMPTS):
                port, bus_port = free_port(), free_port()
                process = _start_node(binary, node_dir, index, port, bus_port)
                processes.append(process)
                client = _wait_for_ping(port, process)
                if client is not None:
                    break
                # A free port stays free only until something binds it: an outgoing
                # connection's ephemeral port took one of the two. New ports, a new start.
                if attempt == BIND_ATTEMPTS - 1:
                    raise RuntimeError(f"cluster node {index} exited: {process.returncode}")
            clients.append(client)
            ports.append(port)
            bus_ports.append(bus_port)
        for client, (first, last) in zip(clients, ranges, strict=True):
            client.execute_command("CLUSTER ADDSLOTSRANGE", first, last)
        for port, bus_port in zip(ports[1:], bus_ports[1:], strict=True):
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", port, bus_port)
        _wait_until_ok(clients)
        for client in clients:
            client.close()
        yield [f"redis://127.0.0.1:{port}" for port in ports]
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def _start_node(
    binary: str, node_dir: Path, index: int, port: int, bus_port: int
) -> subprocess.Popen[bytes]:
    log = open(node_dir / "server.log", "ab")  # noqa: SIM115 - the process holds it
    process = subprocess.Popen(
        # A bus port of its own: the default, port + 10000, may be past 65535.
        [binary, "--port", str(port), "--cluster-port", str(bus_port),
         "--bind", "127.0.0.1", "--dir", str(node_dir),
         "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{index}.conf",
         "--save", "", "--appendonly", "no", "--protected-mode", "no",
         "--hz", str(TEST_SERVER_HZ)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    return process


def _wait_for_ping(port: int, process: subprocess.Popen[bytes]) -> redis.Redis | None:
    """A client of the node once it answers; None if it exited first (it could not bind)."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            return None
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _wait_until_ok(clients: list[redis.Redis]) -> None:
    """Every node sees every slot assigned (cluster_state:ok) and knows all three primaries."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        infos = [client.cluster("INFO") for client in clients]  # redis-py parses it
        if all(
            i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) == len(clients)
            for i in infos
        ):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster did not come up: {infos}")
        time.sleep(0.05)
