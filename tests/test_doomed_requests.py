"""A full batch never carries a request that cannot end by its caller's deadline (DynamicBatcher._drop_doomed): such a
request, were the batch as fast as the fastest of the latest batches its size, is answered DEADLINE_EXCEEDED when the
batch forms (before its deadline passes) and never runs, over gRPC (`grpc-timeout`) and HTTP
(`x-envoy-expected-rq-timeout-ms`); one with the time to be served runs as before. A real server process and a Python
model that sleeps as long as its input says (a batch of two takes `ROUND_S`)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.support import models
from tests.support.server import RunningServer, start_geserve, stop_geserve

MODEL = "slow_pairs"
CONFIG = ('backend: "python"\nmax_batch_size: 2\n'
          'input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]\n'
          'output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]\n'
          'instance_group [{ kind: KIND_CPU, count: 1 }]\n'
          'dynamic_batching { max_queue_delay_microseconds: 200000 }\n')  # a pair sent together batches
ROUND_S = 0.4
Infer = Callable[[float | None], object]  # one request of ROUND_S with that deadline (s); raises its error


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("doomed") / "models"
    models.slow_python(root, MODEL, CONFIG)
    running = start_geserve([root], tmp_path_factory.mktemp("log") / "geserve.log", [])
    try:
        yield running
    finally:
        stop_geserve(running)


def grpc_infer(server: RunningServer) -> Infer:
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def infer(deadline_s: float | None) -> object:
        tensor = grpcclient.InferInput("IN", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.full((1, 1), ROUND_S, np.float32))
        return client.infer(MODEL, [tensor], client_timeout=deadline_s)

    return infer


def http_infer(server: RunningServer) -> Infer:
    def infer(deadline_s: float | None) -> object:
        client = httpclient.InferenceServerClient(server.base.removeprefix("http://"), network_timeout=10)
        tensor = httpclient.InferInput("IN", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.full((1, 1), ROUND_S, np.float32))
        headers = {} if deadline_s is None else {"x-envoy-expected-rq-timeout-ms": str(int(deadline_s * 1000))}
        try:
            return client.infer(MODEL, [tensor], headers=headers)
        finally:
            client.close()

    return infer


def counts(server: RunningServer) -> tuple[int, int, int]:
    """The model's executions, its failed requests, and those failed DEADLINE_EXCEEDED (Prometheus)."""
    with urllib.request.urlopen(f"{server.base}/v2/models/{MODEL}/stats", timeout=10) as response:
        stats = json.loads(response.read())["model_stats"][0]
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
    deadline = sum(
        int(sample.value) for family in families for sample in family.samples
        if sample.name == "nv_inference_request_failure_total"
        and sample.labels.get("model") == MODEL and sample.labels.get("reason") == "DEADLINE_EXCEEDED"
    )
    return stats["execution_count"], stats["inference_stats"]["fail"]["count"], deadline


def executions(server: RunningServer) -> int:
    return counts(server)[0]


def pair(pool: ThreadPoolExecutor, infer: Infer, deadline_s: float | None) -> list[Future[object]]:
    return [pool.submit(infer, deadline_s) for _ in range(2)]


def timed(future: Future[object], sent: float) -> tuple[object, float]:
    """The request's result (or the error it raised) and when it was answered, `sent` taken as 0."""
    try:
        outcome = future.result(timeout=10)
    except InferenceServerException as error:
        outcome = error
    return outcome, time.monotonic() - sent


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_that_cannot_end_by_its_deadline_is_answered_when_its_batch_forms_and_never_runs(
    server: RunningServer, protocol: str
) -> None:
    infer = (grpc_infer if protocol == "grpc" else http_infer)(server)
    with ThreadPoolExecutor(4) as pool:
        for future in pair(pool, infer, None):  # a full batch's time, for the batcher to know
            future.result(timeout=10)
        before = counts(server)
        running = pair(pool, infer, None)  # holds the one instance for ROUND_S
        time.sleep(0.1)
        sent = time.monotonic()
        # Their batch could start after the running one, 0.3 s from now, and end 0.4 s later: past 0.5 s.
        doomed = [timed(future, sent) for future in pair(pool, infer, 0.5)]
        for future in running:
            future.result(timeout=10)
    for outcome, answered in doomed:
        assert isinstance(outcome, InferenceServerException), outcome
        if protocol == "grpc":
            assert outcome.status() == "StatusCode.DEADLINE_EXCEEDED", outcome
        else:
            assert outcome.status() == "504" and "Deadline Exceeded" in outcome.message(), outcome
        assert answered < 0.45, f"answered after {answered:.3f} s: not when the batch formed, 0.3 s in"
    time.sleep(0.1)
    ran, failed, past_deadline = (now - then for now, then in zip(counts(server), before, strict=True))
    assert ran == 1  # the running batch alone: the doomed pair never ran
    assert failed == 2 and past_deadline == 2  # each counted once, under its own reason


def test_a_request_with_the_time_to_be_served_still_runs(server: RunningServer) -> None:
    infer = grpc_infer(server)
    with ThreadPoolExecutor(4) as pool:
        for future in pair(pool, infer, None):
            future.result(timeout=10)
        before = executions(server)
        running = pair(pool, infer, None)
        time.sleep(0.1)
        served = pair(pool, infer, 1.5)  # ends about 0.7 s from now
        for future in running + served:
            result = future.result(timeout=10)
            np.testing.assert_allclose(result.as_numpy("OUT"), [[2 * ROUND_S]])  # type: ignore[attr-defined]
    assert executions(server) - before == 2


def test_an_arrival_takes_a_doomed_requests_place_in_its_batch(server: RunningServer) -> None:
    """A doomed request leaves its full batch short: the batch waits the queue delay (200 ms) for an arrival to take
    its place, and runs full, instead of running a row short and the arrival alone after it."""
    infer = grpc_infer(server)
    with ThreadPoolExecutor(4) as pool:
        for future in pair(pool, infer, None):
            future.result(timeout=10)
        before = executions(server)
        started = time.monotonic()
        running = pair(pool, infer, None)  # the instance is free again 0.4 s from now, when the next batch forms
        time.sleep(0.1)
        queued = [pool.submit(infer, 0.5), pool.submit(infer, None)]  # the first cannot end by its deadline
        time.sleep(max(0.0, started + 0.48 - time.monotonic()))  # after the batch formed, within its queue delay
        late_comer = pool.submit(infer, None)
        for future in [*running, queued[1], late_comer]:
            result = future.result(timeout=10)
            np.testing.assert_allclose(result.as_numpy("OUT"), [[2 * ROUND_S]])  # type: ignore[attr-defined]
        with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
            queued[0].result(timeout=10)
    assert executions(server) - before == 2  # the running pair, then the queued request with the late comer

