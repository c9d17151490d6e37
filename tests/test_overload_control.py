"""Admission control (`--overload-control`, the `overload_control` model parameter) against real server processes
and the real tritonclient: what a model cannot take is refused at arrival (HTTP 503 + Retry-After, gRPC UNAVAILABLE),
counted, lowest priority first and before its deadline would pass in the queue; what it can take is never refused,
nor is a model's own call (an ensemble step, a BLS request).

Every model here is a Python model that sleeps as many seconds as its input says (tests/support/models.slow_python),
on one instance, so how many requests it holds is set by the test, and each test has models of its own: a model's
adaptive limit and measured service time depend only on its own traffic. Where a test needs the model to hold a
known number of requests, it waits for `nv_inference_pending_request_count` to say so before the requests it checks.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import queue
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from geserve.devices.thread_scheduling import SHORTEST_SLICE_S, slice_s
from geserve.devices.thread_scheduling import policy as policy_of
from tests.support import models
from tests.support.ensembles import Ensemble, Step
from tests.support.server import RunningServer, start_geserve, stop_geserve

TENSORS = ('input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]\n'
           'output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]\n'
           'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
DIRECT = f'backend: "python"\nmax_batch_size: 0\n{TENSORS}'  # one request at a time: min_limit 2, limit 4
RANKED = (f'backend: "python"\nmax_batch_size: 2\n{TENSORS}'  # min_limit 4, limit 8; priority 2 gets half of it
          "dynamic_batching { priority_levels: 2 default_priority_level: 2 max_queue_delay_microseconds: 1000 }\n")
BATCHING = {"ranked"}  # its requests carry a batch dimension


def shape(model: str) -> list[int]:
    return [1, 1] if model in BATCHING else [1]


def parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


# The server started with --overload-control on.
ON_MODELS = {
    "burst": DIRECT,
    "calm": DIRECT,
    "ranked": RANKED,
    "exempt": DIRECT + parameter("overload_control", "off"),
    "steady": DIRECT,
    "budgeted": DIRECT,
    "quota": DIRECT + parameter("overload_queue_budget_ms", "120"),
    "together": DIRECT,
    "streamed": DIRECT + "model_transaction_policy { decoupled: true }\n",
    "scheduled": DIRECT,
    "step": DIRECT,  # the step of `pipeline` (an ensemble) and the model `caller` (BLS) calls
}
# The server started without the flag (off by default).
OFF_MODELS = {
    "plain": DIRECT,
    "opted_in": DIRECT + parameter("overload_control", "on"),
    "queued": DIRECT,
}

SLOW_DECOUPLED = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            time.sleep(float(seconds.max()))
            request.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", seconds * 2)]),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
BLS_CALLER = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            answer = pb_utils.InferenceRequest(
                model_name="step", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
            ).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse([], error=pb_utils.TritonError(answer.error().message())))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(answer, "OUT")]))
        return responses
'''


# ------------------------------------------------------------------------------------------------ servers


def _write(root: Path, configs: dict[str, str]) -> Path:
    for name, config in configs.items():
        models.slow_python(root, name, f'name: "{name}"\n{config}')
    return root


@pytest.fixture(scope="module")
def on_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = _write(tmp_path_factory.mktemp("overload_on") / "models", ON_MODELS)
    Ensemble("pipeline", [("IN", "TYPE_FP32", (1,))], [("OUT", "TYPE_FP32", (1,))],
             [Step("step", {"IN": "IN"}, {"OUT": "OUT"})], max_batch_size=0).write(root)
    caller = root / "caller"
    (caller / "1").mkdir(parents=True)
    (caller / "1" / "model.py").write_text(BLS_CALLER)
    (caller / "config.pbtxt").write_text(f'name: "caller"\n{DIRECT}')
    (root / "streamed" / "1" / "model.py").write_text(SLOW_DECOUPLED)
    running = start_geserve([root], tmp_path_factory.mktemp("log") / "geserve.log", ["--overload-control", "on"])
    try:
        yield running
    finally:
        stop_geserve(running)


@pytest.fixture(scope="module")
def off_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = _write(tmp_path_factory.mktemp("overload_off") / "models", OFF_MODELS)
    running = start_geserve([root], tmp_path_factory.mktemp("log") / "geserve.log")
    try:
        yield running
    finally:
        stop_geserve(running)


# ------------------------------------------------------------------------------------------------ calls


@dataclass
class Outcome:
    """One request's end: answered (`value`, its OUT) or refused (`status`: "503" / "StatusCode.UNAVAILABLE", with
    the message, and over HTTP the Retry-After header), and how long the call took."""

    value: float | None = None
    status: str = ""
    message: str = ""
    retry_after: str | None = None
    seconds: float = 0.0

    @property
    def refused(self) -> bool:
        return self.value is None


def http_call(server: RunningServer, model: str, seconds: float, priority: int = 0, timeout_us: int = 0,
              deadline_ms: int = 0, extra_headers: dict[str, str] | None = None) -> Outcome:
    """One inference over HTTP/JSON with the standard library, so the answer's headers can be read; `deadline_ms`:
    a gateway's deadline for the answer (`x-envoy-expected-rq-timeout-ms`)."""
    parameters = {}
    if priority:
        parameters["priority"] = priority
    if timeout_us:
        parameters["timeout"] = timeout_us
    body = json.dumps({"inputs": [{"name": "IN", "shape": shape(model), "datatype": "FP32", "data": [seconds]}],
                       "parameters": parameters})
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    started = time.monotonic()
    try:
        headers = {"Content-Type": "application/json", **(extra_headers or {})}
        if deadline_ms:
            headers["x-envoy-expected-rq-timeout-ms"] = str(deadline_ms)
        connection.request("POST", f"/v2/models/{model}/infer", body, headers)
        response = connection.getresponse()
        payload = json.loads(response.read())
        elapsed = time.monotonic() - started
        if response.status == 200:
            return Outcome(value=payload["outputs"][0]["data"][0], seconds=elapsed)
        return Outcome(status=str(response.status), message=payload.get("error", ""),
                       retry_after=response.getheader("Retry-After"), seconds=elapsed)
    finally:
        connection.close()


def grpc_inputs(model: str, seconds: float) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", shape(model), "FP32")
    tensor.set_data_from_numpy(np.full(shape(model), seconds, np.float32))
    return [tensor]


def grpc_call(client: grpcclient.InferenceServerClient, model: str, seconds: float, priority: int = 0) -> Outcome:
    started = time.monotonic()
    try:
        result = client.infer(model, grpc_inputs(model, seconds), priority=priority, client_timeout=60)
    except InferenceServerException as exc:
        return Outcome(status=str(exc.status()), message=exc.message(), seconds=time.monotonic() - started)
    return Outcome(value=float(result.as_numpy("OUT").ravel()[0]), seconds=time.monotonic() - started)


def raw_grpc_call(server: RunningServer, model: str, seconds: float) -> Outcome:
    """One inference over gRPC with the protocol's own stub, so that the status's trailers can be read: a refusal's
    `grpc-retry-pushback-ms` (gRPC's Retry-After, in ms) becomes `retry_after`."""
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="IN", datatype="FP32", shape=shape(model))
    request.raw_input_contents.append(np.full(shape(model), seconds, np.float32).tobytes())
    started = time.monotonic()
    with grpc.insecure_channel(server.grpc_url) as channel:
        try:
            response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
        except grpc.RpcError as error:
            trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
            return Outcome(status=str(error.code()), message=error.details(),  # type: ignore[attr-defined]
                           retry_after=trailers.get("grpc-retry-pushback-ms"), seconds=time.monotonic() - started)
    value = float(np.frombuffer(response.raw_output_contents[0], np.float32)[0])
    return Outcome(value=value, seconds=time.monotonic() - started)


def assert_refusal(outcome: Outcome, model: str) -> None:
    """A refusal by admission control, as each protocol words it: HTTP 503 with an integer Retry-After >= 1 (seconds),
    gRPC UNAVAILABLE; the message names the model and says why."""
    assert outcome.refused
    assert f"model '{model}' is overloaded" in outcome.message, outcome
    if outcome.status == "503":
        assert outcome.retry_after is not None and outcome.retry_after.isdigit(), outcome
        assert int(outcome.retry_after) >= 1, outcome
    else:
        assert outcome.status == "StatusCode.UNAVAILABLE", outcome


class Load:
    """Requests kept in flight in background threads (gRPC), to fill a model to a known number of held requests."""

    def __init__(self, server: RunningServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self._pool = ThreadPoolExecutor(max_workers=32)
        self.futures: list[Future[Outcome]] = []

    def send(self, call: Callable[..., Outcome], *args: object, **kwargs: object) -> Future[Outcome]:
        future = self._pool.submit(call, *args, **kwargs)
        self.futures.append(future)
        return future

    def grpc(self, model: str, seconds: float, priority: int = 0) -> Future[Outcome]:
        return self.send(grpc_call, self.client, model, seconds, priority)

    def results(self, timeout: float = 60) -> list[Outcome]:
        """Every request's outcome: none lost, none still waiting after `timeout`."""
        return [future.result(timeout=timeout) for future in self.futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        self.client.close()


@pytest.fixture
def load(on_server: RunningServer) -> Iterator[Load]:
    running = Load(on_server)
    try:
        yield running
    finally:
        running.close()


# ------------------------------------------------------------------------------------------------ metrics


Families = dict[str, list]


def scrape(server: RunningServer) -> Families:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    families: Families = {}
    for family in text_string_to_metric_families(text):
        families.setdefault(family.name, []).extend(family.samples)
    return families


def value(families: Families, name: str, **labels: str) -> float:
    """The one sample of `name` (a sample name: `_total`, `_bucket` included) with these labels, 0 if none."""
    matches = [s.value for family in families.values() for s in family
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) <= 1, (name, labels, matches)
    return matches[0] if matches else 0.0


def overload_samples(families: Families, model: str) -> list:
    """Every ge_overload_* sample of `model`."""
    return [s for name, samples in families.items() if name.startswith("ge_overload_")
            for s in samples if s.labels.get("model") == model]


def limit_of(server: RunningServer, model: str) -> int:
    families = scrape(server)
    samples = [s for s in families.get("ge_overload_concurrency_limit", []) if s.labels["model"] == model]
    assert len(samples) == 1, samples
    return int(samples[0].value)


def shed(server: RunningServer, model: str, reason: str) -> float:
    return value(scrape(server), "ge_overload_shed_total", model=model, reason=reason)


def rejected(server: RunningServer, model: str) -> float:
    return value(scrape(server), "nv_inference_request_failure_total", model=model, reason="REJECTED")


def wait_pending(server: RunningServer, model: str, count: int, timeout: float = 20) -> None:
    """Wait until `model` holds exactly `count` requests (its scheduler's own count, as /metrics reports it)."""
    deadline = time.monotonic() + timeout
    held = -1.0
    while time.monotonic() < deadline:
        held = value(scrape(server), "nv_inference_pending_request_count", model=model)
        if held == count:
            return
        time.sleep(0.02)
    raise AssertionError(f"model '{model}' holds {held} requests, not {count}")


def model_stats(server: RunningServer, model: str) -> dict:
    with urllib.request.urlopen(f"{server.base}/v2/models/{model}/stats", timeout=10) as response:
        return json.loads(response.read())["model_stats"][0]


# A fill's first request runs this long, holding the model's one instance; the others, queued behind it, are quick.
# The model holds the whole fill from its last request until the first one ends: the window in which a test sends
# the requests it checks, so it is long enough for a loaded machine.
FIRST_S, REST_S = 1.5, 0.05


def fill(load: Load, server: RunningServer, model: str, count: int) -> list[Future[Outcome]]:
    """`count` requests held by `model` (one running for FIRST_S, the others queued behind it), sent one at a time,
    each after the model holds the ones before it: every one is admitted at a known load (priority 1)."""
    futures = []
    for held in range(count):
        futures.append(load.grpc(model, FIRST_S if held == 0 else REST_S, priority=1))
        wait_pending(server, model, held + 1)
    return futures


def assert_answered(filled: list[Future[Outcome]]) -> None:
    """Every request of a fill was answered, with its own result."""
    values = [future.result(timeout=30).value for future in filled]
    assert values == [pytest.approx(2 * FIRST_S)] + [pytest.approx(2 * REST_S)] * (len(filled) - 1), values


_MEASURED: set[tuple[int, str]] = set()


def measure(server: RunningServer, model: str, seconds: float, count: int = 9) -> None:
    """Sequential requests, more than a window's samples over more than a window (100 ms): admission has measured
    the model's service time (`seconds` per request, and a little more) and updated its limit once they are done.
    Once per server and model: a model's service time stays what it was until it answers more requests."""
    if (server.http_port, model) in _MEASURED:
        return
    for _ in range(count):
        assert http_call(server, model, seconds).value == pytest.approx(2 * seconds)
    _MEASURED.add((server.http_port, model))


def arrive_together(server: RunningServer, model: str, seconds: float, count: int) -> list[int]:
    """`count` HTTP requests on as many connections, read by the server in one turn of its loop: each is sent whole
    but its last byte; then a large JSON request the server decodes on its loop (about 0.1 s for 2M numbers; it is
    then refused for its shape, before admission) is completed, and while the loop is busy with it the last bytes
    are sent. Their statuses."""
    body = json.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32", "data": [seconds]}]}).encode()
    numbers = 2_000_000
    large = (b'{"inputs": [{"name": "IN", "shape": [%d], "datatype": "FP32", "data": [' % numbers
             + b",".join([b"0.5"] * numbers) + b"]}]}")
    blocker = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connections = [http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60) for _ in range(count)]
    try:
        for connection, payload in ((blocker, large), *((c, body) for c in connections)):
            connection.putrequest("POST", f"/v2/models/{model}/infer")
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(payload)))
            connection.endheaders(payload[:-1])
        time.sleep(0.3)  # all of it read by the server, which waits for the last bytes
        blocker.send(large[-1:])
        time.sleep(0.02)
        for connection in connections:
            connection.send(body[-1:])
        refused = blocker.getresponse()
        refused.read()
        assert refused.status == 400, refused.status
        statuses = []
        for connection in connections:
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        return statuses
    finally:
        for connection in (blocker, *connections):
            connection.close()


# ------------------------------------------------------------------------------------------------ tests


def test_off_by_default_nothing_is_refused(off_server: RunningServer) -> None:
    """Without --overload-control, a model far past what admission control would let it hold queues everything:
    each of 12 concurrent requests (one instance, 0.15 s each) is answered, nothing is counted REJECTED, and the
    model has no ge_overload_* sample."""
    client = grpcclient.InferenceServerClient(off_server.grpc_url)
    with ThreadPoolExecutor(max_workers=12) as pool:
        futures = [pool.submit(http_call, off_server, "plain", 0.15) for _ in range(6)]
        futures += [pool.submit(grpc_call, client, "plain", 0.15) for _ in range(6)]
        outcomes = [future.result(timeout=60) for future in futures]
    client.close()
    assert [o.value for o in outcomes] == [pytest.approx(0.3)] * 12, [o for o in outcomes if o.refused]
    families = scrape(off_server)
    assert value(families, "nv_inference_request_failure_total", model="plain", reason="REJECTED") == 0
    assert not overload_samples(families, "plain")


def test_a_burst_past_the_limit_is_refused_and_counted(on_server: RunningServer, load: Load) -> None:
    """With --overload-control on, a one-instance unbatched model starts at a limit of 4 held requests. Filled to
    it, the next request is refused at once over both protocols (HTTP 503 + Retry-After, gRPC UNAVAILABLE with
    `grpc-retry-pushback-ms`, the model named). Then a burst of 16 concurrent requests (8 HTTP, 8 gRPC): each is
    answered correctly or refused, none lost or left waiting, some refused; every refusal is counted REJECTED and as
    shed for `concurrency`, and the limit gauge is there."""
    model = "burst"
    limit = limit_of(on_server, model)
    assert limit == 4  # 2 x the floor, 2 x (1 instance x 1 row)
    before_rejected, before_shed = rejected(on_server, model), shed(on_server, model, "concurrency")

    filled = fill(load, on_server, model, limit)
    over_http = http_call(on_server, model, 0.0)
    over_grpc = raw_grpc_call(on_server, model, 0.0)
    assert_refusal(over_http, model)
    assert over_http.status == "503"
    assert_refusal(over_grpc, model)
    assert over_grpc.status == "StatusCode.UNAVAILABLE"
    # gRPC's Retry-After: the expected wait in ms, a whole number, at least 1
    assert over_grpc.retry_after is not None and over_grpc.retry_after.isdigit(), over_grpc
    assert int(over_grpc.retry_after) >= 1
    # tritonclient's HTTP client sees the same refusal
    client = httpclient.InferenceServerClient(on_server.url)
    tensor = httpclient.InferInput("IN", [1], "FP32")
    tensor.set_data_from_numpy(np.array([0.0], np.float32))
    with pytest.raises(InferenceServerException) as refused:
        client.infer(model, [tensor])
    assert refused.value.status() == "503" and f"model '{model}' is overloaded" in refused.value.message()
    client.close()
    assert_answered(filled)

    burst = Load(on_server)
    try:
        start = threading.Barrier(16)

        def at_once(call: Callable[..., Outcome], *args: object) -> Outcome:
            start.wait(timeout=30)
            return call(*args)

        grpc_client = grpcclient.InferenceServerClient(on_server.grpc_url)
        grpc_client.is_server_live()  # connected before the burst
        for _ in range(8):
            burst.send(at_once, http_call, on_server, model, 0.3)
            burst.send(at_once, grpc_call, grpc_client, model, 0.3)
        outcomes = burst.results(timeout=60)
        grpc_client.close()
    finally:
        burst.close()
    answered = [o for o in outcomes if not o.refused]
    refusals = [o for o in outcomes if o.refused]
    assert len(outcomes) == 16
    assert all(o.value == pytest.approx(0.6) for o in answered)
    for outcome in refusals:
        assert_refusal(outcome, model)
    assert refusals, "a burst of 16 at a limit of 4 refused nothing"
    assert answered

    families = scrape(on_server)
    total_refused = len(refusals) + 3  # and the three refused while the model was full
    assert value(families, "nv_inference_request_failure_total", model=model, reason="REJECTED") - before_rejected \
        == total_refused
    assert value(families, "ge_overload_shed_total", model=model, reason="concurrency") - before_shed \
        == total_refused
    assert value(families, "ge_overload_concurrency_limit", model=model) >= 2  # never under its floor


def test_a_calm_model_lets_requests_with_a_deadline_queue_past_its_limit(on_server: RunningServer, load: Load) -> None:
    """A burst is not a standing overload: a model that refused no one at its limit (4 here) for a second admits a
    request with a deadline past it, up to twice the limit, the queue-time budget judging it. With 4 held (gRPC, each
    with tritonclient's 60 s deadline) a fifth with a 30 s `timeout` is admitted and answered, one without a deadline
    is refused at the limit, and from then on the limit holds for all: the same patient request is refused. A second
    later, calm again, patient requests fill the queue to 8; the ninth is refused. Each refusal is shed for
    `concurrency`."""
    model = "calm"
    measure(on_server, model, 0.05)
    assert limit_of(on_server, model) == 4
    before = shed(on_server, model, "concurrency")
    held = [load.grpc(model, 5.0, priority=1)]  # long enough for the whole test: the queue stays as filled
    wait_pending(on_server, model, 1)
    for count in range(2, 5):
        held.append(load.grpc(model, 0.0, priority=1))
        wait_pending(on_server, model, count)
    patient = partial(http_call, on_server, model, 0.0, timeout_us=30_000_000)
    held.append(load.send(patient))
    wait_pending(on_server, model, 5)
    assert_refusal(http_call(on_server, model, 0.0), model)
    assert_refusal(patient(), model)
    assert shed(on_server, model, "concurrency") == before + 2

    time.sleep(1.1)
    for count in range(6, 9):
        held.append(load.send(patient))
        wait_pending(on_server, model, count)
    ninth = patient()
    assert_refusal(ninth, model)
    assert "concurrency limit" in ninth.message
    assert [future.result(timeout=30).value for future in held] == [10.0] + [0.0] * 7
    assert shed(on_server, model, "concurrency") == before + 3


def test_grpcio_refusals_carry_the_retry_pushback_too(tmp_path: Path) -> None:
    """The grpc.aio transport (`--grpc-server grpcio`) ends a refusal as the native one does: UNAVAILABLE with
    `grpc-retry-pushback-ms`."""
    model = "opted_in"
    root = _write(tmp_path / "models", {model: OFF_MODELS[model]})
    server = start_geserve([root], tmp_path / "geserve.log", ["--grpc-server", "grpcio"])
    load = Load(server)
    try:
        filled = fill(load, server, model, limit_of(server, model))
        assert_refusal(http_call(server, model, 0.0), model)  # no deadline: refused at the limit, which then holds
        refused = raw_grpc_call(server, model, 0.0)
        assert_answered(filled)
    finally:
        load.close()
        stop_geserve(server)
    assert_refusal(refused, model)
    assert refused.retry_after is not None and int(refused.retry_after) >= 1, refused


def test_the_loop_is_batch_scheduled_while_refusing_and_normal_again_after(
    on_server: RunningServer, load: Load
) -> None:
    """While admission control refuses fast, the server's event loop (its main thread) runs as SCHED_BATCH, as the
    kernel reports it: not after one refusal, but within a run of them on one keep-alive connection (20 within 100 ms
    switch it); a second or so after the last refusal it runs as SCHED_OTHER again, with the short slice it had before
    (devices/loop_batching.py)."""
    model = "scheduled"
    loop_thread = on_server.process.pid
    deadline = time.monotonic() + 10
    while policy_of(loop_thread) != os.SCHED_OTHER:  # an earlier test's refusals may still hold it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    filled = fill(load, on_server, model, limit_of(on_server, model))
    assert_refusal(http_call(on_server, model, 0.0), model)
    assert policy_of(loop_thread) == os.SCHED_OTHER
    short = slice_s(loop_thread)
    body = json.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32", "data": [0.0]}]})
    connection = http.client.HTTPConnection("127.0.0.1", on_server.http_port, timeout=60)
    try:
        for _ in range(200):
            connection.request("POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            assert response.status == 503
            if policy_of(loop_thread) == os.SCHED_BATCH:
                break
    finally:
        connection.close()
    assert policy_of(loop_thread) == os.SCHED_BATCH
    assert_answered(filled)
    deadline = time.monotonic() + 10
    while policy_of(loop_thread) != os.SCHED_OTHER:
        assert time.monotonic() < deadline, "the loop stayed batch-scheduled with nothing refused"
        time.sleep(0.1)
    assert slice_s(loop_thread) == short and short in (0.0, SHORTEST_SLICE_S)  # 0.0: a kernel before 6.12


def test_a_restricted_api_judges_a_call_before_admission_control(tmp_path: Path) -> None:
    """With the inference API restricted (--http-restricted-api), a call without its header is refused 403 at a
    model held at its concurrency limit, not 503: the caller's policies come before the model's admission control,
    which refuses (503) the same call with the header. Every request of the fill is answered."""
    root = _write(tmp_path / "models", {"guarded": DIRECT})
    server = start_geserve([root], tmp_path / "geserve.log",
                           ["--overload-control", "on", "--http-restricted-api", "inference:x-key=secret"])
    load = Load(server)  # gRPC is not restricted
    try:
        filled = fill(load, server, "guarded", limit_of(server, "guarded"))
        without_key = http_call(server, "guarded", 0.0)
        with_key = http_call(server, "guarded", 0.0, extra_headers={"x-key": "secret"})
        assert_answered(filled)
    finally:
        load.close()
        stop_geserve(server)
    assert without_key.status == "403", without_key
    assert_refusal(with_key, "guarded")


def test_requests_arriving_together_are_admitted_against_each_other(on_server: RunningServer) -> None:
    """16 requests read by the server in one turn of its loop, at a model with a limit of 4: at most 4 are admitted,
    the others refused (503), as when they arrive one after the other (admission control counts a request held from
    the moment the service takes it, not once its task reaches the model's scheduler)."""
    model = "together"
    limit = limit_of(on_server, model)
    statuses = arrive_together(on_server, model, 0.1, 16)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) <= limit, f"{statuses.count(200)} of 16 admitted at a limit of {limit}"


def test_low_priority_is_shed_first(on_server: RunningServer, load: Load) -> None:
    """With two priority levels, priority 2 (and priority 0, the default level 2) is refused once the model holds
    half its limit, while priority 1 requests sent at that same load are admitted and answered: the model holds
    between limit / 2 and limit when the requests are sent, so the order is fixed."""
    model = "ranked"
    limit = limit_of(on_server, model)
    assert limit == 8  # 2 x the floor, 2 x (1 instance x 2 rows)
    held = limit // 2 + 1
    before = shed(on_server, model, "priority"), shed(on_server, model, "concurrency")
    filled = fill(load, on_server, model, held)  # priority 1: admitted up to the limit

    low_http = http_call(on_server, model, 0.0, priority=2)
    low_grpc = load.grpc(model, 0.0, priority=2).result(timeout=30)
    default = http_call(on_server, model, 0.0)  # priority 0: the default level, 2
    high = [load.send(http_call, on_server, model, 0.0, priority=1), load.grpc(model, 0.0, priority=1)]

    for outcome in (low_http, low_grpc, default):
        assert_refusal(outcome, model)
        assert "priority" in outcome.message
    assert [f.result(timeout=30).value for f in high] == [0.0, 0.0]
    assert_answered(filled)
    assert (shed(on_server, model, "priority"), shed(on_server, model, "concurrency")) == (before[0] + 3, before[1])


def test_the_model_parameter_overrides_the_server_switch(on_server: RunningServer, off_server: RunningServer) -> None:
    """`overload_control: "off"` exempts its model on a server with --overload-control on (12 concurrent requests
    to one instance, all answered, no ge_overload_* sample), and `"on"` controls its model on a server without the
    flag (filled to its limit, the next request is refused and counted)."""
    with ThreadPoolExecutor(max_workers=12) as pool:
        futures = [pool.submit(http_call, on_server, "exempt", 0.1) for _ in range(12)]
        outcomes = [future.result(timeout=60) for future in futures]
    assert [o.value for o in outcomes] == [pytest.approx(0.2)] * 12, [o for o in outcomes if o.refused]
    families = scrape(on_server)
    assert value(families, "nv_inference_request_failure_total", model="exempt", reason="REJECTED") == 0
    assert "ge_overload_concurrency_limit" in families and not overload_samples(families, "exempt")

    load = Load(off_server)
    try:
        limit = limit_of(off_server, "opted_in")
        filled = fill(load, off_server, "opted_in", limit)
        assert_refusal(http_call(off_server, "opted_in", 0.0), "opted_in")
        assert_answered(filled)
    finally:
        load.close()
    assert shed(off_server, "opted_in", "concurrency") == 1
    assert rejected(off_server, "opted_in") == 1


def test_nothing_is_refused_at_low_load(on_server: RunningServer) -> None:
    """Sequential requests with as much idle time as work (half of what the model can take), each with a generous
    timeout and priority 0: after more than a window of them, with the service time measured and the limit
    updated, none has been refused."""
    model = "steady"
    outcomes = []
    for _ in range(14):
        outcomes.append(http_call(on_server, model, 0.03, timeout_us=10_000_000))
        time.sleep(0.03)
    assert [o.value for o in outcomes] == [pytest.approx(0.06)] * 14, [o for o in outcomes if o.refused]
    families = scrape(on_server)
    assert value(families, "nv_inference_request_failure_total", model=model, reason="REJECTED") == 0
    for reason in ("concurrency", "priority", "deadline"):
        assert value(families, "ge_overload_shed_total", model=model, reason=reason) == 0
    assert value(families, "ge_overload_concurrency_limit", model=model) >= 2


def test_a_request_that_cannot_make_its_deadline_is_refused_at_once(on_server: RunningServer, load: Load) -> None:
    """Once the model's service time is measured (about 0.15 s per request), with 3 requests held (the running one
    past the time it should take, so charged half of it for its rest, and the 2 queued: 0.375 s of work ahead, 0.525 s
    to the end of a new one) a
    request that cannot make it is refused at arrival, well before either passes: its queue timeout (`timeout`,
    0.3 s) passes before its turn (HTTP 503 with Retry-After), or the caller's deadline (gRPC's 0.3 s, and 0.5 s,
    after its turn but before its end; the HTTP gateway header's 300 ms) before its end (gRPC UNAVAILABLE, not
    DEADLINE_EXCEEDED later), each shed for `deadline`. A queue timeout bounds only the wait: one of 0.55 s, whose
    turn comes in time by the estimate, is admitted (here its turn comes later, behind the 1.5 s request: it is
    answered "Request timeout expired" at 0.55 s, as it would be without admission control). One with a 30 s
    timeout at the same load is admitted and answered."""
    model = "budgeted"
    measure(on_server, model, 0.15)
    before = shed(on_server, model, "deadline")
    assert limit_of(on_server, model) > 3
    filled = fill(load, on_server, model, 3)
    time.sleep(0.2)  # the one running (FIRST_S) is past the time it should take: its rest is not known

    short = http_call(on_server, model, 0.0, timeout_us=300_000)
    assert_refusal(short, model)
    assert short.status == "503" and "deadline" in short.message
    assert short.seconds < 0.3, f"refused after {short.seconds:.3f} s"
    gateway = http_call(on_server, model, 0.0, deadline_ms=300)
    assert_refusal(gateway, model)
    assert gateway.status == "503" and "deadline" in gateway.message
    assert gateway.seconds < 0.3, f"refused after {gateway.seconds:.3f} s"
    for deadline_s in (0.3, 0.5):
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as called:
            load.client.infer(model, grpc_inputs(model, 0.0), client_timeout=deadline_s)
        assert called.value.status() == "StatusCode.UNAVAILABLE", called.value
        assert f"model '{model}' is overloaded" in called.value.message()
        assert time.monotonic() - started < 0.3
    assert shed(on_server, model, "deadline") == before + 4

    queued = http_call(on_server, model, 0.0, timeout_us=550_000)
    assert (queued.status, queued.message) == ("503", "Request timeout expired"), queued
    assert 0.55 <= queued.seconds < 1.0, queued
    patient = load.send(http_call, on_server, model, 0.0, timeout_us=30_000_000)
    assert patient.result(timeout=30).value == 0.0
    assert_answered(filled)
    assert shed(on_server, model, "deadline") == before + 4


def test_the_queue_budget_refuses_a_request_without_a_deadline(on_server: RunningServer, load: Load) -> None:
    """`overload_queue_budget_ms` (120 ms here) stands for the deadline of a request without one: once the service
    time is measured (about 0.1 s), with 2 requests held a request without a timeout is refused at once (503 +
    Retry-After, shed for `deadline`): the one queued is 0.1 s of work, and the one running has overrun the 0.1 s it
    should take, so half of that is charged for its rest. The second request of the fill was admitted with 1 held (the
    rest of the one running, 0.1 s at most, ahead of it)."""
    model = "quota"
    measure(on_server, model, 0.1)
    before = shed(on_server, model, "deadline")
    filled = fill(load, on_server, model, 2)
    time.sleep(0.15)  # the one running (FIRST_S) is past the time it should take
    refused = http_call(on_server, model, 0.0)
    assert_refusal(refused, model)
    assert refused.status == "503" and "deadline" in refused.message
    assert shed(on_server, model, "deadline") == before + 1
    assert_answered(filled)


def test_the_queue_budget_leaves_a_request_with_a_deadline_to_its_deadline(
    on_server: RunningServer, load: Load
) -> None:
    """The queue budget stands in for a timeout only: at the load where the budget refuses a request without one
    (2 held, about 0.15 s ahead, budget 120 ms), a request with a 30 s `timeout` is judged by it, admitted and
    answered."""
    model = "quota"
    measure(on_server, model, 0.1)
    filled = fill(load, on_server, model, 2)
    patient = http_call(on_server, model, 0.0, timeout_us=30_000_000)
    assert_answered(filled)
    assert patient.value == 0.0, patient


def test_a_decoupled_models_stream_requests_are_admitted_too(on_server: RunningServer) -> None:
    """A decoupled model's requests (gRPC streams) are calls from outside like any other: filled to its limit with
    requests on streams, the model refuses the next one, its error in the stream naming the model."""
    model = "streamed"
    limit = limit_of(on_server, model)
    clients = [grpcclient.InferenceServerClient(on_server.grpc_url) for _ in range(limit + 1)]
    answers: list[queue.Queue] = [queue.Queue() for _ in clients]
    try:
        for client, answer in zip(clients, answers, strict=True):
            client.start_stream(partial(_streamed, answer))
        for held, client in enumerate(clients[:limit]):  # filled as `fill` does, a stream a request
            client.async_stream_infer(model, grpc_inputs(model, FIRST_S if held == 0 else REST_S))
            wait_pending(on_server, model, held + 1)
        clients[-1].async_stream_infer(model, grpc_inputs(model, 0.0))
        last = answers[-1].get(timeout=30)
        values = [answer.get(timeout=30) for answer in answers[:-1]]
        assert values == [pytest.approx(2 * FIRST_S)] + [pytest.approx(2 * REST_S)] * (limit - 1), values
    except BaseException:
        for client in clients:  # else stop_stream waits for every request sent on it to be answered
            client.stop_stream(cancel_requests=True)
        raise
    finally:
        for client in clients:
            client.stop_stream()
            client.close()
    assert isinstance(last, InferenceServerException), f"admitted past the limit: {last}"
    # a stream's error is a message in the stream (no status of its own), as Triton's streams carry them
    assert f"model '{model}' is overloaded" in last.message(), last


def _streamed(answers: queue.Queue, result: grpcclient.InferResult | None, error: Exception | None) -> None:
    if error is not None:
        answers.put(error)
    elif result is not None and result.as_numpy("OUT") is not None:
        answers.put(float(result.as_numpy("OUT").ravel()[0]))


def test_queue_duration_histogram(off_server: RunningServer) -> None:
    """ge_inference_queue_duration_seconds, kept for every model (here one without admission control): after 6
    concurrent requests queued behind each other on one instance, its buckets are cumulative and end at its count,
    the count is the number of requests the model executed, and the sum (what they waited) is more than 0."""
    model = "queued"
    with ThreadPoolExecutor(max_workers=6) as pool:
        outcomes = list(pool.map(lambda _: http_call(off_server, model, 0.1), range(6)))
    assert [o.value for o in outcomes] == [pytest.approx(0.2)] * 6
    families = scrape(off_server)
    samples = [s for s in families["ge_inference_queue_duration_seconds"] if s.labels["model"] == model]
    buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
    (count,) = [s.value for s in samples if s.name.endswith("_count")]
    (total,) = [s.value for s in samples if s.name.endswith("_sum")]
    bounds = [bound for bound, _ in buckets]
    assert bounds == sorted(bounds) and math.isinf(bounds[-1])
    counts = [n for _, n in buckets]
    assert counts == sorted(counts) and counts[-1] == count
    stats = model_stats(off_server, model)
    assert count == 6 == stats["inference_stats"]["queue"]["count"] == stats["inference_count"]
    assert total > 0.1  # the last of them waited behind the others' 0.1 s each
    assert total == pytest.approx(stats["inference_stats"]["queue"]["ns"] / 1e9)


def test_a_models_own_calls_are_never_shed(on_server: RunningServer, load: Load) -> None:
    """Filled to its limit, `step` refuses a request from outside, but the calls made to it from inside the server,
    as a step of the ensemble `pipeline` and as a BLS request of the Python model `caller`, are admitted (they serve
    requests already admitted) and answered; none of them counts as shed."""
    model = "step"
    limit = limit_of(on_server, model)
    filled = fill(load, on_server, model, limit)
    before = shed(on_server, model, "concurrency")
    assert_refusal(http_call(on_server, model, 0.0), model)

    ensemble = load.send(http_call, on_server, "pipeline", 0.05)
    bls = load.grpc("caller", 0.05)
    wait_pending(on_server, model, limit + 2)  # both calls are held by `step`, past its limit
    assert ensemble.result(timeout=30).value == pytest.approx(0.1), ensemble.result()
    assert bls.result(timeout=30).value == pytest.approx(0.1), bls.result()
    assert_answered(filled)
    assert shed(on_server, model, "concurrency") == before + 1
    for name in ("pipeline", "caller"):
        assert model_stats(on_server, name)["inference_stats"]["fail"]["count"] == 0
