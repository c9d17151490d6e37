"""Clean exits on a real server process: SIGTERM turns readiness false and refuses new requests at once, lets the
requests in flight (queued in the dynamic batcher, executing, or on an open gRPC stream) finish within
--exit-timeout-secs, then exits 0; a second SIGTERM exits at once."""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import models
from tests.support.server import RunningServer, start_geserve, stop_geserve

SLOW_CONFIG = '''
backend: "python"
max_batch_size: 4
input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]
output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
dynamic_batching { max_queue_delay_microseconds: 1000 }
'''


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exit") / "models"
    models.slow_python(root, "slow", SLOW_CONFIG)
    return root


@pytest.fixture
def running(slow_repo: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    server = start_geserve([slow_repo], tmp_path / "geserve.log", ["--exit-timeout-secs", str(request.param)])
    try:
        yield server
    finally:
        stop_geserve(server)


def _infer_http(server: RunningServer, seconds: float) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    try:
        tensor = httpclient.InferInput("IN", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.array([[seconds]], np.float32))
        return client.infer("slow", [tensor]).as_numpy("OUT")
    finally:
        client.close()


def _ready_status(server: RunningServer) -> int:
    try:
        with urllib.request.urlopen(server.base + "/v2/health/ready", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _start(work: list[threading.Thread]) -> None:
    for thread in work:
        thread.start()


def _wait_exit(server: RunningServer, within_s: float) -> int:
    return server.process.wait(within_s)


@pytest.mark.parametrize("running", [20], indirect=True)
def test_sigterm_drains_what_is_in_flight_and_refuses_new_work(running: RunningServer) -> None:
    results: queue.Queue[object] = queue.Queue()

    def call() -> None:
        try:
            results.put(_infer_http(running, 0.6))
        except Exception as exc:  # collected and asserted below
            results.put(exc)

    streamed: queue.Queue[object] = queue.Queue()
    stream_client = grpcclient.InferenceServerClient(running.grpc_url)
    stream_client.start_stream(callback=lambda result, error: streamed.put(error or result.as_numpy("OUT")))
    tensor = grpcclient.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[0.6]], np.float32))
    stream_client.async_stream_infer("slow", [tensor])
    callers = [threading.Thread(target=call) for _ in range(6)]  # more rows than one batch: some wait queued
    _start(callers)
    time.sleep(0.3)
    running.process.send_signal(signal.SIGTERM)
    time.sleep(0.2)

    assert _ready_status(running) == 400  # not ready at once
    with pytest.raises(InferenceServerException, match="shutting down") as refused:
        _infer_http(running, 0.0)
    assert refused.value.status() == "503"
    grpc_client = grpcclient.InferenceServerClient(running.grpc_url)
    with pytest.raises(InferenceServerException, match="shutting down") as refused:
        grpc_client.infer("slow", [tensor])
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    grpc_client.close()

    for thread in callers:
        thread.join(30)
    answers = [results.get_nowait() for _ in callers]
    assert all(isinstance(a, np.ndarray) and a.tolist() == [[pytest.approx(1.2)]] for a in answers), answers
    streamed_answer = streamed.get(timeout=30)
    assert isinstance(streamed_answer, np.ndarray) and streamed_answer.tolist() == [[pytest.approx(1.2)]]
    stream_client.stop_stream()
    stream_client.close()
    assert _wait_exit(running, 20) == 0
    assert "in-flight requests" in running.log()


def _abandoned_call(server: RunningServer) -> threading.Thread:
    """An 8 s request, left to fail when the server goes away."""

    def call() -> None:
        with contextlib.suppress(Exception):
            _infer_http(server, 8.0)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


@pytest.mark.parametrize("running", [1], indirect=True)
def test_the_exit_timeout_bounds_the_wait(running: RunningServer) -> None:
    caller = _abandoned_call(running)
    time.sleep(0.3)
    started = time.monotonic()
    running.process.send_signal(signal.SIGTERM)
    assert _wait_exit(running, 15) == 1  # not a clean exit: a request was abandoned
    assert time.monotonic() - started < 6.0  # the 1 s timeout and the closing, not the 8 s request
    assert "still in flight are abandoned" in running.log()
    caller.join(15)


@pytest.mark.parametrize("running", [30], indirect=True)
def test_a_second_sigterm_exits_at_once(running: RunningServer) -> None:
    caller = _abandoned_call(running)
    time.sleep(0.3)
    running.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert running.process.poll() is None  # draining: the 8 s request is still in flight
    started = time.monotonic()
    running.process.send_signal(signal.SIGTERM)
    assert _wait_exit(running, 5) == 1
    assert time.monotonic() - started < 2.0
    caller.join(15)
