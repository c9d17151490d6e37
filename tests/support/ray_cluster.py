"""A local multi-node Ray cluster for tests and benchmarks: `ray start --head` plus more `ray start --address`
nodes on this machine, on free ports and a private temporary directory, torn down to the last process.

Each node runs as `ray start --block` in a session of its own: stopping sends it SIGTERM (Ray then stops the
node's processes), and whatever is left in that session (workers, replicas, HAProxy) is killed after a grace
period. `ray stop` is never used: it stops every Ray process on the machine, other users' too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.reference import RAY_WORKER_PORTS, free_port

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")


@dataclass
class RayCluster:
    address: str  # the GCS, host:port
    temp_dir: Path
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def session_logs(self) -> Path:
        return self.temp_dir / "session_latest" / "logs"

    def serve_log(self, pattern: str = "replica_*.log") -> str:
        """The text of the Serve logs matching `pattern` (replicas by default), concatenated."""
        folder = self.session_logs / "serve"
        return "".join(p.read_text(errors="replace") for p in sorted(folder.glob(pattern)))


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        "RAY_DEDUP_LOGS": "0",
        # The proxy sends requests to its own node's replicas while they keep up; the tests want both replicas
        # (on two nodes of one host) to serve through the head's proxy.
        "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
    })
    return env


_WORKER_PORTS = 201  # ports in one node's worker range (Ray's minimum is one per worker)


def _node_ports(worker_low: int) -> list[str]:
    """The per-node ports `ray start` would otherwise take at fixed numbers (two nodes on one host collide). Workers
    take theirs from the range at `worker_low`."""
    return [
        f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        f"--min-worker-port={worker_low}", f"--max-worker-port={worker_low + _WORKER_PORTS - 1}",
    ]


def _worker_ports(nodes: int) -> int:
    """The first of `nodes` adjacent worker ranges, within RAY_WORKER_PORTS. Every other port of the cluster is a
    free_port(), which never hands out one of those: a node port inside a worker range ("worker_ports is trying to
    use a port number that is used by other components") stops the node from starting."""
    span = nodes * _WORKER_PORTS
    room = max(1, len(RAY_WORKER_PORTS) - span)
    return RAY_WORKER_PORTS.start + free_port() % room  # random within the room: parallel runs rarely meet


def _start_node(args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", *args], stdout=out, stderr=subprocess.STDOUT,
            env=ray_env(), start_new_session=True,
        )


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def _wait_nodes(address: str, count: int, nodes: list[subprocess.Popen[bytes]], log: Path, timeout: float) -> None:
    """Until the GCS lists `count` live nodes (asked by a short child process, so this one stays Ray-free)."""
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            if node.poll() is not None:
                raise RuntimeError(f"a Ray node exited with {node.returncode}:\n{log.read_text()[-3000:]}")
        # A driver started before the GCS listens hangs in its reconnect loop for minutes: probe only once the
        # port accepts, and retry a probe that hangs all the same (a loaded machine) rather than fail.
        if _accepts(address):
            probe_limit = min(30.0, max(5.0, deadline - time.monotonic()))
            with contextlib.suppress(subprocess.TimeoutExpired):
                result = subprocess.run([sys.executable, "-c", probe, address], capture_output=True, text=True,
                                        env=ray_env(), timeout=probe_limit, check=False)
                if result.returncode == 0 and result.stdout.strip().splitlines()[-1:] == [str(count)]:
                    return
        time.sleep(1)
    raise RuntimeError(f"the Ray cluster did not reach {count} nodes in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def ray_cluster(temp_dir: Path, cpus: Sequence[float] = (1, 1), timeout: float = 180.0) -> Iterator[RayCluster]:
    """A head node and one node more per entry of `cpus` after the first, each with that many CPUs."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = temp_dir / "nodes.log"
    gcs_port = free_port()
    cluster = RayCluster(f"127.0.0.1:{gcs_port}", temp_dir)
    worker_low = _worker_ports(len(cpus))
    try:
        cluster.nodes.append(_start_node([
            "--head", f"--port={gcs_port}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus[0]}",
            "--num-gpus=0", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
            f"--dashboard-port={free_port()}",  # its minimal head starts even without the dashboard, on 8265
            f"--temp-dir={temp_dir}", "--object-store-memory=100000000", *_node_ports(worker_low),
        ], log))
        _wait_nodes(cluster.address, 1, cluster.nodes, log, timeout)
        for index, count in enumerate(cpus[1:], 1):
            cluster.nodes.append(_start_node([
                f"--address={cluster.address}", "--node-ip-address=127.0.0.1", f"--num-cpus={count}",
                "--num-gpus=0", "--object-store-memory=100000000", *_node_ports(worker_low + index * _WORKER_PORTS),
            ], log))
        _wait_nodes(cluster.address, len(cpus), cluster.nodes, log, timeout)
        yield cluster
    finally:
        stop_cluster(cluster)


def session_members(session: int) -> list[int]:
    """The processes of a session (by /proc), whatever process group they moved to: Ray's HAProxy manager starts
    HAProxy in a group of its own, which a killpg of the node's group would miss."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == session:  # after ")": state, ppid, pgrp, session
                    members.append(int(entry.name))
    return members


def stop_cluster(cluster: RayCluster, grace: float = 20.0) -> None:
    """Workers' nodes first, then the head; each node's process group is killed if it outlives `grace`."""
    for node in reversed(cluster.nodes):
        with contextlib.suppress(ProcessLookupError):
            node.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(grace)
        for pid in session_members(node.pid):  # our own session: the node's leftovers, nobody else's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.wait(5)
    cluster.nodes.clear()
