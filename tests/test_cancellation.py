"""Request cancellation: a client that goes away takes its queued requests out of the batcher (they never run, and
count as CANCELED), while a request already executing finishes its batch and only its result is dropped.

Unit tests drive the dynamic batcher, the direct scheduler and the instance pool in pure asyncio; integration tests
run a real server with a slow Python model (one instance, dynamic batching, so requests queue behind the one that
executes) and cancel through tritonclient's gRPC `async_infer(...).cancel()`, `stop_stream(cancel_requests=True)`
and raw HTTP sockets that close. The model records which requests it executed and which it saw cancelled
(`request.is_cancelled()`), in marker files. The sequence batcher's rule is tested in test_sequence_cancellation.py."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from geserve.scheduling.direct import DirectScheduler
from geserve.scheduling.dynamic_batcher import DynamicBatcher
from geserve.scheduling.pool import InstancePool
from geserve.statistics import ModelStatistics
from tests.support.server import RunningServer, geserve
from tests.test_dynamic_batcher import RecordingInstance, hold, request, run, settings

# ---- unit: the dynamic batcher, the direct scheduler, the pool --------------------------------------------------


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_a_cancelled_queued_request_leaves_the_queue_and_never_runs() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        first, gone, last = (asyncio.ensure_future(batcher.enqueue(request(rid))) for rid in ("a", "gone", "b"))
        await asyncio.sleep(0.05)
        assert batcher.inflight_count == 4
        gone.cancel()
        await asyncio.sleep(0)
        assert batcher.inflight_count == 3  # out of the queue at once, not when a batch would have taken it
        fakes[0].gate.set()
        responses = await asyncio.gather(held, first, last)
        assert [r.id for r in responses] == ["hold", "a", "b"]
        assert gone.cancelled()

    fakes = run(body, settings())
    assert fakes[0].batches == [["hold"], ["a", "b"]]


def test_cancelling_the_only_queued_request_frees_the_instance_the_batch_waited_with() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        # A long queue delay: the batcher holds the instance while it waits for more requests.
        waiting = asyncio.ensure_future(batcher.enqueue(request("waiting")))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await _until(lambda: batcher.inflight_count == 0)
        started = time.monotonic()
        response = await batcher.enqueue(request("next", rows=2))  # a preferred batch alone: it goes at once
        assert response.id == "next"
        assert time.monotonic() - started < 5  # had the cancelled request stayed, both would wait its 10 s delay

    fakes = run(body, settings(max_queue_delay_ns=10_000_000_000, preferred_batch_sizes=(2,)))
    assert fakes[0].batches == [["next"]]


def test_a_cancelled_request_in_an_executing_batch_leaves_the_others_unaffected() -> None:
    gone_request = request("gone")

    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        stays = asyncio.ensure_future(batcher.enqueue(request("stays")))
        gone = asyncio.ensure_future(batcher.enqueue(gone_request))
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        await held
        await _until(lambda: len(fakes[0].batches) == 2)  # their batch is executing (the instance takes 0.2 s)
        gone.cancel()
        await asyncio.sleep(0)
        assert gone_request.cancelled  # what a model polling is_cancelled() reads
        response = await stays
        assert response.id == "stays"
        np.testing.assert_array_equal(response.outputs[0].data, np.full((1, 4), 10.0))
        assert gone.cancelled()

    fakes = run(body, settings(), delay=0.2)
    assert fakes[0].batches == [["hold"], ["stays", "gone"]]  # it ran with its batch; its result was dropped


def test_preserve_ordering_goes_on_past_a_cancelled_request() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        tasks = [asyncio.ensure_future(batcher.enqueue(request(rid, rows=8))) for rid in ("a", "gone", "b")]
        await asyncio.sleep(0.05)
        tasks[1].cancel()
        fakes[0].gate.set()
        responses = await asyncio.wait_for(asyncio.gather(held, tasks[0], tasks[2]), 5)
        assert [r.id for r in responses] == ["hold", "a", "b"]

    fakes = run(body, settings(preserve_ordering=True))
    assert fakes[0].batches == [["hold"], ["a"], ["b"]]


def test_a_request_cancelled_after_its_batch_was_taken_but_before_it_ran_is_dropped() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        stays, gone = (asyncio.ensure_future(batcher.enqueue(request(rid))) for rid in ("stays", "gone"))
        take = batcher._wait_for_batch

        async def take_then_cancel() -> list[Any]:
            # The window: the batch is out of the queue and its dispatch task not yet started.
            batch = await take()
            if any(p.request.id == "gone" for p in batch):
                gone.cancel()
            return batch

        batcher._wait_for_batch = take_then_cancel  # type: ignore[method-assign]
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        await held
        assert (await stays).id == "stays"
        await asyncio.sleep(0.05)
        assert gone.cancelled()

    fakes = run(body, settings())
    assert fakes[0].batches == [["hold"], ["stays"]]


def test_a_cancelled_request_waiting_for_an_instance_in_the_direct_scheduler_never_runs() -> None:
    fake = RecordingInstance()
    statistics = ModelStatistics()

    async def main() -> None:
        scheduler = DirectScheduler(InstancePool("m", [fake], statistics))
        fake.gate.clear()
        busy = asyncio.ensure_future(scheduler.enqueue(request("busy")))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(scheduler.enqueue(request("gone")))
        await asyncio.sleep(0.05)
        gone.cancel()
        await asyncio.sleep(0)
        fake.gate.set()
        assert (await busy).id == "busy"
        assert (await scheduler.enqueue(request("after"))).id == "after"
        await scheduler.stop()

    asyncio.run(main())
    assert fake.batches == [["busy"], ["after"]]
    assert statistics.execution_count == 2


def test_an_execution_whose_caller_was_cancelled_is_still_counted() -> None:
    fake = RecordingInstance()
    statistics = ModelStatistics()

    async def main() -> None:
        pool = InstancePool("m", [fake], statistics)
        scheduler = DirectScheduler(pool)
        fake.gate.clear()
        running = asyncio.ensure_future(scheduler.enqueue(request("running")))
        await asyncio.sleep(0.05)
        running.cancel()
        await asyncio.sleep(0.01)
        fake.gate.set()
        assert (await scheduler.enqueue(request("after"))).id == "after"  # the instance came back
        await scheduler.stop()

    asyncio.run(main())
    assert fake.batches == [["running"], ["after"]]
    assert (statistics.execution_count, statistics.inference_count) == (2, 2)


# ---- integration: a real server ---------------------------------------------------------------------------------

SLOW_MODEL = '''
import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sleeps for the largest IN of its batch, polling is_cancelled(); records what it ran and saw cancelled."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.markers = Path(config["parameters"]["marker_dir"]["string_value"])

    def execute(self, requests):
        for request in requests:
            (self.markers / f"executed-{request.request_id()}").touch()
        seconds = max(float(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().max()) for r in requests)
        deadline = time.monotonic() + seconds
        seen = set()
        while time.monotonic() < deadline:
            for request in requests:
                if request.request_id() not in seen and request.is_cancelled():
                    seen.add(request.request_id())
                    (self.markers / f"cancelled-{request.request_id()}").touch()
            if len(seen) == len(requests):
                break  # every client left: stop early, as Triton's docs suggest
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
'''
SLOW_CONFIG = '''
backend: "python"
max_batch_size: 4
input [{{ name: "IN", data_type: TYPE_FP32, dims: [1] }}]
output [{{ name: "OUT", data_type: TYPE_FP32, dims: [1] }}]
instance_group [{{ kind: KIND_CPU, count: 1 }}]
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
parameters {{ key: "marker_dir" value {{ string_value: "{markers}" }} }}
'''
MODELS = ("grpc_unary", "grpc_executing", "grpc_stream", "http_disconnect")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    base = tmp_path_factory.mktemp("cancellation")
    markers = base / "markers"
    markers.mkdir()
    root = base / "models"
    for name in MODELS:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(SLOW_CONFIG.format(markers=markers))
        (root / name / "1" / "model.py").write_text(SLOW_MODEL)
    with geserve([root], base / "geserve.log") as server:
        yield server, markers


def _stats(server: RunningServer, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.base}/v2/models/{model}/stats", timeout=5) as response:
        return json.loads(response.read())["model_stats"][0]  # type: ignore[no-any-return]


def _metric(server: RunningServer, family: str, model: str, **labels: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(family + "{") and f'model="{model}"' in line and all(
            f'{key}="{value}"' in line for key, value in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {family} sample for {model} {labels}")


def _wait(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _pending(server: RunningServer, model: str) -> float:
    return _metric(server, "nv_inference_pending_request_count", model)


def _executed(markers: Path, model_ids: tuple[str, ...]) -> set[str]:
    return {rid for rid in model_ids if (markers / f"executed-{rid}").exists()}


def _grpc_input(seconds: float) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[seconds]], np.float32))
    return tensor


def _doubled(seconds: float) -> np.ndarray:
    return np.array([[seconds]], np.float32) * 2


def _canceled(server: RunningServer, model: str) -> float:
    return _metric(server, "nv_inference_request_failure", model, reason="CANCELED")


def test_grpc_unary_cancel_takes_a_queued_request_out_of_the_batcher(served: tuple[RunningServer, Path]) -> None:
    server, markers = served
    model = "grpc_unary"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: dict[str, queue.Queue[Any]] = {rid: queue.Queue() for rid in ("u-blocker", "u-gone", "u-stays")}

    def call(rid: str, seconds: float) -> Any:
        return client.async_infer(model, [_grpc_input(seconds)], request_id=rid,
                                  callback=lambda result, error: results[rid].put((result, error)))

    try:
        call("u-blocker", 1.5)
        _wait(lambda: (markers / "executed-u-blocker").exists())
        gone = call("u-gone", 0.01)
        call("u-stays", 0.01)
        _wait(lambda: _pending(server, model) == 3)  # one executing, two queued
        gone.cancel()
        _, error = results["u-gone"].get(timeout=10)
        assert isinstance(error, InferenceServerException) and "CANCELLED" in str(error.status())
        for rid in ("u-blocker", "u-stays"):
            result, error = results[rid].get(timeout=20)
            assert error is None, error
            np.testing.assert_array_equal(result.as_numpy("OUT"), _doubled(1.5 if rid == "u-blocker" else 0.01))
        _wait(lambda: _stats(server, model)["inference_stats"]["fail"]["count"] == 1)
        stats = _stats(server, model)
        assert stats["inference_stats"]["success"]["count"] == 2
        assert stats["inference_stats"]["fail"]["count"] == 1  # once, not once per layer
        assert (stats["inference_count"], stats["execution_count"]) == (2, 2)
        assert _canceled(server, model) == 1
        assert _metric(server, "nv_inference_request_failure", model, reason="OTHER") == 0
        assert _executed(markers, ("u-blocker", "u-gone", "u-stays")) == {"u-blocker", "u-stays"}
    finally:
        client.close()


def test_grpc_cancel_of_an_executing_request_finishes_its_batch_and_the_model_sees_it(
    served: tuple[RunningServer, Path],
) -> None:
    server, markers = served
    model = "grpc_executing"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: dict[str, queue.Queue[Any]] = {rid: queue.Queue() for rid in ("e-blocker", "e-gone", "e-mate")}

    def call(rid: str, seconds: float) -> Any:
        return client.async_infer(model, [_grpc_input(seconds)], request_id=rid,
                                  callback=lambda result, error: results[rid].put((result, error)))

    try:
        call("e-blocker", 0.5)
        _wait(lambda: (markers / "executed-e-blocker").exists())
        gone = call("e-gone", 1.5)
        call("e-mate", 1.5)  # batched with e-gone once the blocker is done
        _wait(lambda: (markers / "executed-e-gone").exists())
        gone.cancel()
        _wait(lambda: (markers / "cancelled-e-gone").exists(), 5)  # the model polled is_cancelled()
        result, error = results["e-mate"].get(timeout=20)
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("OUT"), _doubled(1.5))
        assert not (markers / "cancelled-e-mate").exists()
        _wait(lambda: _stats(server, model)["inference_stats"]["fail"]["count"] == 1)
        stats = _stats(server, model)
        assert stats["inference_stats"]["success"]["count"] == 2
        assert (stats["inference_count"], stats["execution_count"]) == (3, 2)  # it ran, in its batch
        assert _canceled(server, model) == 1
    finally:
        client.close()


def test_grpc_stream_cancel_takes_its_queued_requests_out(served: tuple[RunningServer, Path]) -> None:
    server, markers = served
    model = "grpc_stream"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors: queue.Queue[Any] = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: errors.put(error))
        client.async_stream_infer(model, [_grpc_input(1.5)], request_id="s-running")
        _wait(lambda: (markers / "executed-s-running").exists())
        for rid in ("s-queued-1", "s-queued-2"):
            client.async_stream_infer(model, [_grpc_input(0.01)], request_id=rid)
        _wait(lambda: _pending(server, model) == 3)
        client.stop_stream(cancel_requests=True)  # the whole call ends: every request on it is cancelled
        _wait(lambda: (markers / "cancelled-s-running").exists(), 5)
        _wait(lambda: _stats(server, model)["inference_stats"]["fail"]["count"] == 3)
        _wait(lambda: _pending(server, model) == 0)
        time.sleep(0.3)  # were they still queued, they would run now
        stats = _stats(server, model)
        assert stats["inference_stats"]["success"]["count"] == 0
        assert (stats["inference_count"], stats["execution_count"]) == (1, 1)
        assert _canceled(server, model) == 3
        assert _executed(markers, ("s-running", "s-queued-1", "s-queued-2")) == {"s-running"}
    finally:
        client.close()


def _http_request(model: str, rid: str, seconds: float) -> bytes:
    body = json.dumps({"id": rid, "inputs": [{"name": "IN", "shape": [1, 1], "datatype": "FP32",
                                              "data": [seconds]}]}).encode()
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def _send(server: RunningServer, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=20)
    sock.sendall(payload)
    return sock


def test_http_disconnect_cancels_the_queued_and_the_executing_request(served: tuple[RunningServer, Path]) -> None:
    server, markers = served
    model = "http_disconnect"
    executing = _send(server, _http_request(model, "h-executing", 3.0))
    _wait(lambda: (markers / "executed-h-executing").exists())
    queued = _send(server, _http_request(model, "h-queued", 0.01))
    stays = _send(server, _http_request(model, "h-stays", 0.01))
    try:
        _wait(lambda: _pending(server, model) == 3)
        queued.close()
        _wait(lambda: _pending(server, model) == 2)  # out of the queue at once
        executing.close()
        _wait(lambda: (markers / "cancelled-h-executing").exists(), 5)  # the model stops early
        answer = b""
        while b'"OUT"' not in answer or not answer.rstrip().endswith(b"}"):
            chunk = stays.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        output = json.loads(answer.split(b"\r\n\r\n", 1)[1])["outputs"][0]["data"]
        np.testing.assert_array_equal(np.array([output], np.float32), _doubled(0.01))
        _wait(lambda: _stats(server, model)["inference_stats"]["fail"]["count"] == 2)
        stats = _stats(server, model)
        assert stats["inference_stats"]["success"]["count"] == 1
        assert (stats["inference_count"], stats["execution_count"]) == (2, 2)
        assert _canceled(server, model) == 2
        assert _executed(markers, ("h-executing", "h-queued", "h-stays")) == {"h-executing", "h-stays"}
    finally:
        stays.close()

