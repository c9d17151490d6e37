"""geserve as a Ray Serve deployment (geserve/integrations): the options from flags and YAML, then a real local
Ray cluster of two nodes (`ray start --head` plus `ray start --address`, one CPU each), `geserve ray-serve` with
two replicas on it, and tritonclient over HTTP and gRPC through Ray's proxies.

The cluster tests are marked `ray` (about a minute and a half together on two cores): `-m "not ray"` leaves them
out. Nothing is mocked; a replica is killed with `ray.kill`, as Ray's own docs simulate a replica failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geserve.integrations.ray_options import RayOptionsError, build_options, load_yaml
from tests.support import models
from tests.support.ray_cluster import RayCluster, ray_cluster, ray_env
from tests.support.reference import free_port
from tests.support.security import simple_inputs

# ------------------------------------------------------------------------------------------ options, no Ray


def test_flags_override_the_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "ray.yaml"
    path.write_text("num_replicas: 3\nray_actor_options: {num_cpus: 2, num_gpus: 1}\nmax_ongoing_requests: 64\n")
    options = build_options(load_yaml(path), num_cpus=0.5)
    assert options.deployment == {
        "num_replicas": 3, "max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1},
    }
    assert options.replicas_text() == "3 replicas"


def test_autoscaling_replaces_the_replica_count(tmp_path: Path) -> None:
    path = tmp_path / "ray.yaml"
    path.write_text("autoscaling_config: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 32}\n")
    options = build_options(load_yaml(path), max_replicas=8)
    assert "num_replicas" not in options.deployment  # Ray refuses both
    assert options.deployment["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 32,
    }
    # a count on the command line wins over the file's autoscaling
    assert "autoscaling_config" not in build_options(load_yaml(path), num_replicas=2).deployment


def test_unknown_or_contradictory_options_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ray.yaml"
    path.write_text("num_replica: 2\n")
    with pytest.raises(RayOptionsError, match="unknown deployment option 'num_replica'"):
        build_options(load_yaml(path))
    path.write_text("ray_actor_options: {cpus: 1}\n")
    with pytest.raises(RayOptionsError, match="ray_actor_options"):
        build_options(load_yaml(path))
    with pytest.raises(RayOptionsError, match="exclude each other"):
        build_options(num_replicas=2, min_replicas=1)
    with pytest.raises(RayOptionsError, match="positive"):
        build_options(num_replicas=0)


# Ray's destructor is `async def __del__` (Ray awaits it); Python's collector calls it once more and drops it.
@pytest.mark.filterwarnings("ignore:coroutine 'GeserveReplica.__del__' was never awaited:RuntimeWarning")
def test_replica_health_is_geserve_readiness(tmp_path: Path) -> None:
    """Ray's check_health on a replica's server core, outside Ray (only the Ray-free part of the replica runs)."""
    pytest.importorskip("ray.serve")
    import asyncio

    from geserve.integrations.ray_serve import GeserveReplica, NotReady
    from geserve.server import Server
    from geserve.settings import ServerSettings

    models.simple(tmp_path)

    async def scenario() -> None:
        replica = GeserveReplica.__new__(GeserveReplica)  # the constructor needs Ray's replica context
        replica.server = Server(ServerSettings(model_repositories=[tmp_path], allow_http=False, allow_grpc=False,
                                               allow_metrics=False, exit_timeout_secs=5))
        await replica.server.start()
        await replica.check_health()  # every model ready
        replica.server.service.stop_accepting()  # what a stopping replica does first
        with pytest.raises(NotReady):
            await replica.check_health()
        await replica.__del__()  # Ray's destructor call: the drain, then the models unload

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------- a real Ray cluster

SUCCESS = re.compile(r'^nv_inference_request_success\{model="simple",version="1"\} (\S+)$', re.MULTILINE)
REPLICAS = "SERVE_REPLICA::geserve#geserve#"


@dataclass
class Deployment:
    process: subprocess.Popen[bytes]
    log: Path
    cluster: RayCluster
    http_port: int
    grpc_port: int
    metrics_ports: tuple[int, int]

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"


def _two_free_ports() -> int:
    """A port whose next one is free too (replica ranks 0 and 1 serve metrics on base and base + 1)."""
    import socket

    for _ in range(50):
        base = free_port()
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", base + 1))
            return base
    raise RuntimeError("no two consecutive free ports")


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _successes(port: int) -> float:
    """The replica's nv_inference_request_success for `simple`, from its own /metrics."""
    _, text = _get(f"http://127.0.0.1:{port}/metrics")
    match = SUCCESS.search(text)
    return float(match.group(1)) if match else 0.0


def _ray_script(cluster_address: str, body: str, timeout: float = 120) -> str:
    """Run `body` in a short Ray driver of its own (this process stays out of Ray); its stdout."""
    code = f"import ray, sys, time\nray.init(address={cluster_address!r}, log_to_driver=False)\n{body}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ray_env(),
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


LIST_REPLICAS = f"""
def replicas():
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith({REPLICAS!r}))
"""


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    pytest.importorskip("ray.serve")
    # Short: Ray's unix sockets live under the temporary directory, and their paths have a length limit.
    temp = Path(tempfile.mkdtemp(prefix="geray", dir="/tmp"))
    try:
        with ray_cluster(temp / "ray", cpus=(1, 1)) as cluster:
            repo = temp / "repo"
            models.simple(repo, max_batch_size=8, extra="dynamic_batching { }")
            http_port, grpc_port, metrics_base = free_port(), free_port(), _two_free_ports()
            log = temp / "geserve.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "geserve", "ray-serve", "--model-repository", str(repo),
                     "--ray-address", cluster.address, "--num-replicas", "2", "--num-cpus", "1",
                     "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                     "--metrics-port", str(metrics_base), "--proxy-location", "HeadOnly",
                     "--exit-timeout-secs", "10"],
                    stdout=out, stderr=subprocess.STDOUT, env=ray_env(), start_new_session=True,
                )
            deployed = Deployment(process, log, cluster, http_port, grpc_port, (metrics_base, metrics_base + 1))
            try:
                _wait_ready(deployed, timeout=150)
                yield deployed
            finally:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(60)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait(5)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _wait_ready(deployed: Deployment, timeout: float) -> None:
    """Ready through the proxy, and both replicas' metrics endpoints up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if deployed.process.poll() is not None:
            raise RuntimeError(f"geserve ray-serve exited {deployed.process.returncode}:\n{deployed.log.read_text()}")
        with contextlib.suppress(OSError):
            if (_get(f"http://{deployed.url}/v2/health/ready")[0] == 200
                    and all(_get(f"http://127.0.0.1:{p}/metrics")[0] == 200 for p in deployed.metrics_ports)):
                return
        time.sleep(1)
    raise RuntimeError(f"the deployment was not ready in {timeout:.0f} s:\n{deployed.log.read_text()[-3000:]}")


@pytest.mark.ray
def test_tritonclient_http_and_grpc_through_the_proxies(deployment: Deployment) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    expected = 2 * np.arange(16, dtype=np.int32).reshape(1, 16)
    http = httpclient.InferenceServerClient(deployment.url)
    assert http.is_server_ready() and http.is_model_ready("simple")
    assert (http.infer("simple", simple_inputs(httpclient)).as_numpy("OUTPUT0") == expected).all()
    assert http.get_model_metadata("simple")["platform"] == "onnxruntime_onnx"

    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{deployment.grpc_port}")
    assert grpc.is_server_live() and grpc.is_server_ready()
    assert (grpc.infer("simple", simple_inputs(grpcclient)).as_numpy("OUTPUT0") == expected).all()
    assert grpc.get_model_config("simple", as_json=True)["config"]["max_batch_size"] == 8
    assert grpc.get_model_metadata("simple", as_json=True)["versions"] == ["1"]  # what perf_analyzer reads first
    with pytest.raises(grpcclient.InferenceServerException, match="unknown model") as caught:
        grpc.infer("missing", simple_inputs(grpcclient))
    assert caught.value.status() == "StatusCode.NOT_FOUND"  # geserve's status, carried through Ray's proxy

    answers: list[tuple[Any, Any]] = []
    done = threading.Event()

    def collect(result: Any, error: Any) -> None:
        answers.append((result, error))
        if len(answers) == 3:
            done.set()

    grpc.start_stream(callback=collect)  # the bidirectional ModelStreamInfer, through Ray's streaming proxy
    try:
        for index in range(3):
            grpc.async_stream_infer("simple", simple_inputs(grpcclient), request_id=str(index))
        assert done.wait(30)
    finally:
        grpc.stop_stream()
    assert sorted(r.get_response().id for r, e in answers if e is None) == ["0", "1", "2"]


@pytest.mark.ray
def test_two_replicas_both_serve(deployment: Deployment) -> None:
    """Each replica's own /metrics (rank 0 and rank 1) counts a share of the requests, and together all of them."""
    import tritonclient.http as httpclient

    before = [_successes(port) for port in deployment.metrics_ports]
    sent = 80

    def send(count: int) -> None:
        client = httpclient.InferenceServerClient(deployment.url)
        for _ in range(count):
            client.infer("simple", simple_inputs(httpclient))

    threads = [threading.Thread(target=send, args=(sent // 4,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    served = [_successes(port) - start for port, start in zip(deployment.metrics_ports, before, strict=True)]
    assert all(count > 0 for count in served), served
    assert sum(served) == sent, served
    # the statistics extension answers per replica, through the proxy: never more than one replica's count
    stats = httpclient.InferenceServerClient(deployment.url).get_inference_statistics("simple")
    assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) <= max(served) + before[0] + before[1]


@pytest.mark.ray
def test_a_killed_replica_is_replaced_and_retried_requests_succeed(deployment: Deployment) -> None:
    import tritonclient.http as httpclient

    finished: list[float] = []
    retried = failed = 0
    stop = threading.Event()
    lock = threading.Lock()

    def load() -> None:
        nonlocal retried, failed
        client = httpclient.InferenceServerClient(deployment.url, connection_timeout=10, network_timeout=10)
        while not stop.is_set():
            for attempt in range(20):  # the client retries, as a client of any replicated service does
                try:
                    client.infer("simple", simple_inputs(httpclient))
                    break
                except Exception:
                    with lock:
                        retried += 1
                    time.sleep(0.1 * (attempt + 1))
            else:
                with lock:
                    failed += 1
                continue
            with lock:
                finished.append(time.monotonic())

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(6)
        baseline_window = (time.monotonic() - 4, time.monotonic())
        killed_at = time.monotonic()
        # kill one replica mid-load, then wait for Ray to bring the deployment back to two
        out = _ray_script(deployment.cluster.address, LIST_REPLICAS + """
before = replicas()
ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
start = time.monotonic()
while time.monotonic() - start < 60:
    now = replicas()
    if len(now) == 2 and before[0] not in now:
        break
    time.sleep(0.5)
print(before[0]); print(",".join(now))
""")
        victim, now = out.strip().splitlines()[-2:]
        replacement_deadline = killed_at + 30
        time.sleep(max(0.0, min(replacement_deadline - time.monotonic(), 12)))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert victim not in now.split(",") and len(now.split(",")) == 2, (victim, now)
    assert failed == 0, f"{failed} requests failed after 20 tries ({retried} retries)"

    def rate(start: float, end: float) -> float:
        return sum(1 for t in finished if start <= t < end) / (end - start)

    baseline = rate(*baseline_window)
    # the first 2-second window after the kill whose throughput is back to 70% of the baseline or more (the
    # surviving replica carries the load meanwhile: on two cores one replica nearly keeps up with two)
    back = next((t for t in np.arange(killed_at, killed_at + 30, 0.5) if rate(t, t + 2) >= 0.7 * baseline), None)
    after = [round(rate(t, t + 2)) for t in np.arange(killed_at, killed_at + 30, 2)]
    assert back is not None and back - killed_at <= 30, (baseline, after)
    print(f"baseline {baseline:.0f} req/s; back at {back - killed_at:.1f} s after the kill; {retried} retries")
    # the replacement took the killed replica's rank: both metrics endpoints answer again
    _wait_ready(deployment, timeout=30)


@pytest.mark.ray
def test_stopping_drains_every_replica(deployment: Deployment) -> None:
    """SIGTERM to `geserve ray-serve`: Serve shuts down, each replica drains as `geserve serve` does."""
    cluster = deployment.cluster
    deployment.process.send_signal(signal.SIGTERM)
    assert deployment.process.wait(90) == 0, deployment.log.read_text()[-3000:]
    log = cluster.serve_log()
    assert log.count("geserve replica stopped (drained)") >= 2, log[-3000:]
    deadline = time.monotonic() + 15
    while _port_open(deployment.http_port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _port_open(deployment.http_port), "Ray's HTTP proxy still listens after the shutdown"


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0
