"""`--workers N`: several processes on the same ports that behave as one server, through the real tritonclient.

Each request below that must be able to land on any worker opens a new connection (a new client): the supervisor
hands each new connection to the worker holding the fewest (geserve/workers/dispatch.py), so a run of them reaches
every worker."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve.settings import ServerSettings
from geserve.statistics import merge_statistics
from geserve.workers.dispatch import GRPC, HTTP, handed_kinds
from geserve.workers.metrics_merge import merge_expositions
from geserve.workers.supervisor import MAX_AUTO_WORKERS, worker_count
from tests.support import models
from tests.support.reference import free_port
from tests.support.server import REPO_ROOT, RunningServer, geserve
from tests.support.shm import Region

ROUNDS = 24  # new connections per check: the chance that all land on one of two workers is 2 * 2**-24


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def http_connections(server: RunningServer, port: int | None = None) -> list[int]:
    """Established connections to the HTTP port (or `port`) each worker holds (from /proc: its socket descriptors'
    inodes)."""
    port = server.http_port if port is None else port
    established: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                established.add(fields[9])
    counts = []
    for pid in server.children():
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        counts.append(len(inodes & established))
    return counts


def live_connection(server: RunningServer) -> socket.socket:
    """A connection that has been answered once, so a worker holds it."""
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    return sock


def simple_request(client: httpclient.InferenceServerClient, model: str = "simple") -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return client.infer(model, inputs).as_numpy("OUTPUT0")


def fresh(server: RunningServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def wait_ready(server: RunningServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(fresh(server).is_server_ready() for _ in range(8)):
                return
        except ConnectionRefusedError:  # no worker listens yet
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready within {timeout} s:\n{server.log()[-3000:]}")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workers") / "models"
    models.simple(root)
    models.simple(root, name="spare")
    models.accumulator(root)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("logs") / "workers.log"
    args = ["--workers", "2", "--model-control-mode", "explicit", "--load-model", "simple", "--load-model",
            "accumulator", "--allow-system-shared-memory"]
    with geserve([repo], log, args) as running:
        wait_ready(running)
        yield running


def test_two_workers_share_the_ports_and_both_serve(server: RunningServer) -> None:
    workers = server.children()
    assert len(workers) == 2
    before = [cpu_ticks(pid) for pid in workers]
    for _ in range(ROUNDS * 4):
        assert simple_request(fresh(server))[0, 3] == 4
    after = [cpu_ticks(pid) for pid in workers]
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)


def test_connections_are_spread_evenly_and_their_closes_counted(server: RunningServer) -> None:
    first = [live_connection(server) for _ in range(8)]
    second: list[socket.socket] = []
    try:
        assert http_connections(server) == [4, 4]
        for sock in first[:3] + first[-1:]:  # the supervisor learns of these closes, whichever worker held them
            sock.close()
        deadline = time.monotonic() + 10
        while sum(http_connections(server)) > 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # the workers' reports reach the supervisor
        second = [live_connection(server) for _ in range(4)]
        assert http_connections(server) == [4, 4]
    finally:
        for sock in first + second:
            sock.close()


def test_grpc_connections_are_spread_evenly_too(server: RunningServer) -> None:
    # A subchannel pool of its own per client: grpc would otherwise share one connection among them.
    clients = [grpcclient.InferenceServerClient(server.grpc_url, channel_args=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(4)]
    try:
        assert all(client.is_server_live() for client in clients)
        assert http_connections(server, server.grpc_port) == [2, 2]
    finally:
        for client in clients:
            client.close()


def test_at_the_connection_cap_new_clients_wait_for_a_place(repo: Path, tmp_path: Path) -> None:
    """--http-max-connections is each worker's: beyond them all, a client waits in the backlog (as with one process),
    and is served once a place frees up."""
    args = ["--workers", "2", "--model-control-mode", "explicit", "--load-model", "simple",
            "--http-max-connections", "1"]
    with geserve([repo], tmp_path / "log", args) as running:
        wait_ready(running)
        held = [live_connection(running) for _ in range(2)]
        waiting = socket.create_connection(("127.0.0.1", running.http_port), timeout=10)
        try:
            waiting.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            waiting.settimeout(1.0)
            with pytest.raises(TimeoutError):
                waiting.recv(4096)
            held.pop().close()
            waiting.settimeout(10)
            assert waiting.recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            waiting.close()
            for sock in held:
                sock.close()


def test_statistics_and_metrics_answer_for_the_whole_server(server: RunningServer) -> None:
    def count() -> int:
        stats = fresh(server).get_inference_statistics("simple")["model_stats"][0]
        return int(stats["inference_stats"]["success"]["count"])

    start = count()
    for _ in range(ROUNDS):
        simple_request(fresh(server))
    assert all(count() == start + ROUNDS for _ in range(8))  # whichever worker answers
    grpc_stats = grpcclient.InferenceServerClient(server.grpc_url).get_inference_statistics("simple", as_json=True)
    assert int(grpc_stats["model_stats"][0]["inference_stats"]["success"]["count"]) == start + ROUNDS
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith('nv_inference_request_success{model="simple"'))
    assert float(line.rsplit(" ", 1)[1]) == start + ROUNDS
    assert text.count("# TYPE nv_cpu_utilization gauge") == 1


def test_model_control_reaches_every_worker(server: RunningServer) -> None:
    fresh(server).load_model("spare")
    assert all(simple_request(fresh(server), "spare")[0, 0] == 1 for _ in range(ROUNDS))
    fresh(server).unload_model("spare")
    for _ in range(ROUNDS):
        with pytest.raises(InferenceServerException, match="spare"):
            simple_request(fresh(server), "spare")
    assert all(fresh(server).is_server_ready() for _ in range(8))


def test_a_shared_memory_region_registered_once_serves_every_worker(server: RunningServer) -> None:
    region = Region(64)
    try:
        data = np.arange(16, dtype=np.int32)
        region.memory[:64] = data.tobytes()
        fresh(server).register_system_shared_memory("inputs", region.key, 64)
        for _ in range(ROUNDS):
            client = fresh(server)
            inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_shared_memory("inputs", 64)
            out = client.infer("simple", inputs).as_numpy("OUTPUT0")
            assert out.tolist() == [list(range(0, 32, 2))]
        assert all(
            [r["name"] for r in fresh(server).get_system_shared_memory_status()] == ["inputs"] for _ in range(8)
        )
        fresh(server).unregister_system_shared_memory("inputs")
        assert all(fresh(server).get_system_shared_memory_status() == [] for _ in range(8))
    finally:
        region.close()


def test_a_sequence_continues_on_whichever_worker_a_new_connection_reaches(server: RunningServer) -> None:
    def step(value: int, start: bool = False, end: bool = False) -> int:
        tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        result = fresh(server).infer("accumulator", [tensor], sequence_id=4242, sequence_start=start,
                                     sequence_end=end, outputs=[httpclient.InferRequestedOutput("OUTPUT")])
        return int(result.as_numpy("OUTPUT")[0, 0])

    total = step(1, start=True)
    for value in range(2, ROUNDS):
        total_before = total
        total = step(value)
        assert total == total_before + value
    assert step(100, end=True) == total + 100
    with pytest.raises(InferenceServerException, match="must specify the START flag"):
        step(1)  # ended: no worker holds it


def kill_a_worker(server: RunningServer) -> None:
    """SIGKILL one worker, and wait until the supervisor has replaced it and every worker is ready."""
    victim = server.children()[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while victim in server.children() or len(server.children()) < 2:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    wait_ready(server)


def test_a_killed_worker_is_restarted_with_the_servers_models(server: RunningServer) -> None:
    fresh(server).load_model("spare")
    kill_a_worker(server)
    assert all(simple_request(fresh(server), "spare")[0, 0] == 1 for _ in range(ROUNDS))  # replayed load
    fresh(server).unload_model("spare")
    assert "restarting it" in server.log()


def test_sigterm_stops_every_worker_cleanly(repo: Path, tmp_path: Path) -> None:
    with geserve([repo], tmp_path / "log", ["--workers", "2", "--model-control-mode", "explicit",
                                            "--load-model", "simple"]) as running:
        wait_ready(running)
        workers = running.children()
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(30) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_a_worker_that_cannot_start_fails_the_start(repo: Path, tmp_path: Path) -> None:
    args = ["--workers", "2", "--model-control-mode", "explicit", "--load-model", "missing"]
    with pytest.raises(RuntimeError, match="exited with 1"), geserve([repo], tmp_path / "log", args):
        pass


def test_the_supervisor_hands_over_only_the_native_servers_connections() -> None:
    base = ServerSettings(model_repositories=[Path(".")])
    assert handed_kinds(base) == {HTTP, GRPC}
    assert handed_kinds(dataclasses.replace(base, http_server="uvicorn")) == {GRPC}  # uvicorn binds its own port
    assert handed_kinds(dataclasses.replace(base, grpc_use_ssl_mutual=True)) == {HTTP, GRPC}  # TLS too
    assert handed_kinds(dataclasses.replace(base, grpc_server="grpcio", allow_http=False)) == frozenset()


def test_the_default_is_one_worker_per_core_capped() -> None:
    assert worker_count(0) == min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS)
    assert worker_count(3) == 3


def test_statistics_of_workers_add_up() -> None:
    one = {"name": "m", "version": "1", "last_inference": 5, "inference_count": 2, "execution_count": 1,
           "inference_stats": {"success": {"count": 2, "ns": 10}},
           "batch_stats": [{"batch_size": 2, "compute_infer": {"count": 1, "ns": 7}}]}
    two = {"name": "m", "version": "1", "last_inference": 9, "inference_count": 1, "execution_count": 1,
           "inference_stats": {"success": {"count": 1, "ns": 4}},
           "batch_stats": [{"batch_size": 1, "compute_infer": {"count": 1, "ns": 3}}]}
    merged = merge_statistics([{"model_stats": [one]}, {"model_stats": [two]}])["model_stats"][0]
    assert merged["last_inference"] == 9 and merged["inference_count"] == 3
    assert merged["inference_stats"]["success"] == {"count": 3, "ns": 14}
    assert [b["batch_size"] for b in merged["batch_stats"]] == [1, 2]


def test_metrics_of_workers_add_up_but_machine_gauges_do_not() -> None:
    text = (
        "# HELP nv_inference_request_success Number of successful inference requests, all batch sizes\n"
        "# TYPE nv_inference_request_success counter\n"
        'nv_inference_request_success{model="m",version="1"} 5\n'
        "# TYPE nv_cpu_utilization gauge\nnv_cpu_utilization 0.5\n"
        "# TYPE nv_inference_pending_request_count gauge\n"
        'nv_inference_pending_request_count{model="m",version="1"} 2\n'
        '# TYPE q summary\nq{quantile="0.5"} 10\nq_count 2\n'
    )
    other = text.replace(" 0.5\n", " 0.7\n").replace(" 10\n", " 30\n")
    merged = merge_expositions([text, other]).decode().splitlines()
    assert 'nv_inference_request_success{model="m",version="1"} 10' in merged
    assert "nv_cpu_utilization 0.5" in merged
    assert 'nv_inference_pending_request_count{model="m",version="1"} 4' in merged
    assert 'q{quantile="0.5"} 30' in merged and "q_count 4" in merged
    assert merged.count("# TYPE nv_inference_request_success counter") == 1


def test_log_and_trace_settings_change_on_every_worker(server: RunningServer) -> None:
    fresh(server).update_log_settings({"log_verbose_level": 2})
    assert all(fresh(server).get_log_settings()["log_verbose_level"] == 2 for _ in range(ROUNDS))
    fresh(server).update_log_settings({"log_verbose_level": 0})
    fresh(server).update_trace_settings("simple", {"trace_rate": "7"})
    assert all(fresh(server).get_trace_settings("simple")["trace_rate"] == "7" for _ in range(ROUNDS))
    fresh(server).update_trace_settings("simple", {"trace_rate": None})


def in_its_own_session(repo: Path, log_path: Path) -> RunningServer:
    """Two workers serving `simple`, the supervisor leading a process group of its own (as from a terminal)."""
    port = free_port()
    command = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(repo), "--workers", "2",
               "--http-port", str(port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
               "--model-control-mode", "explicit", "--load-model", "simple"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                   start_new_session=True)
    return RunningServer(process, port, log_path)


def test_ctrl_c_to_the_process_group_drains_every_worker_once(repo: Path, tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the supervisor's process group: it stops its workers (each in a session of its
    own) over their links, and each drains once."""
    running = in_its_own_session(repo, tmp_path / "log")
    process = running.process
    try:
        wait_ready(running)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(30) == 0, running.log()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "second signal received" not in running.log()


def test_sighup_while_workers_start_does_not_fail_the_start(repo: Path, tmp_path: Path) -> None:
    """A certificate rotation (SIGHUP) that comes while workers are still loading their models: they read the
    files when they start serving, and the start goes on."""
    running = in_its_own_session(repo, tmp_path / "log")
    process = running.process
    try:
        deadline = time.monotonic() + 30
        while "worker 1 started" not in running.log():
            assert time.monotonic() < deadline and process.poll() is None, running.log()[-3000:]
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGHUP)  # the supervisor and the workers still importing
        wait_ready(running)
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, running.log()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
