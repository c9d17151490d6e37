"""Deadlines end to end on a real server process through the real tritonclient (service/deadlines.py). Two kinds:

- the caller's deadline for the answer (gRPC's `grpc-timeout`, HTTP's gateway header `x-envoy-expected-rq-timeout-ms`,
  an ensemble's for its steps): it holds while the request runs too, so a request queued behind a busy model is
  answered DEADLINE_EXCEEDED (HTTP 504) at it and never runs, and one whose execution outlasts it is answered at it
  all the same (the result is dropped: a success is never delivered late);
- Triton's queue timeout (the `timeout` parameter, a queue policy's default timeout, a BLS call's `timeout=`): it
  holds until the request starts, so a request still queued at it is answered with Triton's words and code
  (UNAVAILABLE "Request timeout expired", HTTP 503) and never runs, and one that started runs to its end.

Either is answered within 50 + 10 ms of sending a request with a 50 ms one, over HTTP, gRPC unary and gRPC streaming,
batched or not, inside an ensemble step and from a BLS call; the model's statistics show one execution (the busy
one) and /metrics one DEADLINE_EXCEEDED failure. A Python model sees the time the caller's deadline leaves it
(`request.deadline()`), and nothing of a queue timeout.

Timing: each bound is measured on the client from just before the call that sends the request until the call
returns (or its callback runs), so it holds the client library's own work and both transfers as well as the server's
timer. The busy request sleeps BUSY_S (0.6 s), so nothing but the deadline can answer the timed one before then. On
a 2-core machine the answers come 50.5-53.5 ms after sending (the server's timer runs about 0.3 ms late, each
transfer takes under 1 ms; gRPC's client adds a thread hop). Where other processes keep both cores busy, each process
woken on the way (the server reading the request, its timer, the client reading the answer) may wait a scheduler
slice (4-5 ms measured) for a core, and three such waits exceed the bound: no server can answer sooner there.

No call here can hang the suite: every blocking client call gives up after CALL_TIMEOUT_S (HTTP's network timeout,
gRPC's `client_timeout` where the test gives the call a deadline, else `grpc_infer`'s bounded wait, which sends
none), every wait on an event is bounded, and a stream that failed is stopped with its requests cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import uvloop
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from geserve.errors import DeadlineExceededError, GeserveError, QueueTimeoutError
from geserve.service.deadlines import Watched, delivery_allowance
from geserve.types import InferenceRequest
from tests.support import models
from tests.support.ensembles import Ensemble, Step
from tests.support.server import RunningServer, geserve

DEADLINE_US = 50_000
DEADLINE_S = DEADLINE_US / 1e6
BOUND_S = 0.010  # the bound: the deadline plus 10 ms
BUSY_S = 0.6  # what the request holding the model's one instance sleeps
SETTLE_S = 0.15  # after sending the busy request, before the timed one: the busy one is running by then
LIFE_S = 0.2  # a caller's deadline shorter than the execution of its request
RUNNING_S = 0.5  # that execution
CALL_TIMEOUT_S = 30  # the longest any client call here waits: a failure never hangs the suite
TIMEOUT_ERROR = "Request timeout expired"  # Triton's words for a request that waited past its queue timeout
DEADLINE_ERROR = "Deadline Exceeded"  # gRPC's words for a passed deadline (the server's and the client's own)
HTTP_DEADLINE = "x-envoy-expected-rq-timeout-ms"  # a gateway's deadline for the answer, in ms

_IO = ('input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]\n'
       'output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]\n'
       'instance_group [{ kind: KIND_CPU, count: 1 }]\n')


def _batched(policy: str, extra: str = "") -> str:
    return (f'backend: "python"\nmax_batch_size: 4\n{_IO}'
            f"dynamic_batching {{ max_queue_delay_microseconds: 0 default_queue_policy {{ {policy} }} {extra} }}\n")


SLOW = {
    # the `timeout` parameter may set the queue timeout (Triton's allow_timeout_override)
    "slow_batched": _batched("allow_timeout_override: true"),
    # no batcher: the `timeout` parameter is the queue timeout
    "slow_direct": f'backend: "python"\nmax_batch_size: 0\n{_IO}',
    # a 50 ms queue timeout with no parameter: the queue policy's default timeout (REJECT is the default action). The
    # busy request is sent at priority 2, whose queue has no timeout (see test_a_request_started_before_...).
    "slow_policy": _batched(f"default_timeout_microseconds: {DEADLINE_US}",
                            "priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 2 value { } }"),
    # the `timeout` parameter is ignored: the policy does not let a request override its (absent) timeout
    "slow_no_override": _batched("allow_timeout_override: false"),
}
BATCHED = {"slow_batched", "slow_policy", "slow_no_override", "ens_batched", "ens_policy"}

# Calls TARGET (a BLS call with `timeout` = TIMEOUT_US, 0: none) with IN = zeros of shape SHAPE, and answers what it
# got: ERROR (its error message, "" when none), CODE (the TritonError's code, -1 when none), ELAPSED_MS (how long
# exec() took) and LEFT (the target's own LEFT output when it has one, else -2).
BLS_CALLER = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        def value(name):
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

        target = value("TARGET").ravel()[0].decode()
        shape = [int(d) for d in value("SHAPE").ravel()]
        timeout = int(value("TIMEOUT_US").ravel()[0])
        call = pb_utils.InferenceRequest(
            model_name=target, requested_output_names=[],
            inputs=[pb_utils.Tensor("IN", np.zeros(shape, np.float32))], timeout=timeout,
        )
        started = time.monotonic()
        response = call.exec()
        elapsed_ms = (time.monotonic() - started) * 1000
        error = response.error() if response.has_error() else None
        left = pb_utils.get_output_tensor_by_name(response, "LEFT") if error is None else None
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("ERROR", np.array([b"" if error is None else error.message().encode()], np.object_)),
            pb_utils.Tensor("CODE", np.array([-1 if error is None else error.code()], np.int32)),
            pb_utils.Tensor("ELAPSED_MS", np.array([elapsed_ms], np.float32)),
            pb_utils.Tensor("LEFT", np.array([-2.0], np.float64) if left is None else left.as_numpy().reshape(1)),
        ])
'''
BLS_CONFIG = '''backend: "python"
max_batch_size: 0
input [
  { name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "SHAPE" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "TIMEOUT_US" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [
  { name: "ERROR" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "CODE" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ELAPSED_MS" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "LEFT" data_type: TYPE_FP64 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
'''

# LEFT = request.deadline(): the seconds it has left, -1 without a deadline.
DEADLINE_PROBE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            left = request.deadline()
            rows = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().shape[:-1]
            value = np.full((*rows, 1), -1.0 if left is None else left, np.float64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("LEFT", value)]))
        return responses
'''
_PROBE_IO = ('input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]\n'
             'output [{ name: "LEFT", data_type: TYPE_FP64, dims: [1] }]\n')
PROBES = {
    "probe_direct": f'backend: "python"\nmax_batch_size: 0\n{_PROBE_IO}',
    "probe_policy": f'backend: "python"\nmax_batch_size: 4\n{_PROBE_IO}'
                    "dynamic_batching { default_queue_policy { default_timeout_microseconds: 900000 } }\n",
}

ENSEMBLES = (
    Ensemble("ens_direct", [("IN", "TYPE_FP32", [1])], [("OUT", "TYPE_FP32", [1])],
             [Step("slow_direct", {"IN": "IN"}, {"OUT": "OUT"})], max_batch_size=0),
    Ensemble("ens_batched", [("IN", "TYPE_FP32", [1])], [("OUT", "TYPE_FP32", [1])],
             [Step("slow_batched", {"IN": "IN"}, {"OUT": "OUT"})], max_batch_size=4),
    Ensemble("ens_policy", [("IN", "TYPE_FP32", [1])], [("OUT", "TYPE_FP32", [1])],
             [Step("slow_policy", {"IN": "IN"}, {"OUT": "OUT"})], max_batch_size=4),
    Ensemble("ens_probe", [("IN", "TYPE_FP32", [1])], [("LEFT", "TYPE_FP64", [1])],
             [Step("probe_direct", {"IN": "IN"}, {"LEFT": "LEFT"})], max_batch_size=0),
)
STEP_OF = {"ens_direct": "slow_direct", "ens_batched": "slow_batched", "ens_policy": "slow_policy"}

LATENCIES: list[tuple[str, float]] = []  # (case, seconds): printed at the module's end (`pytest -s` shows them)


def _python_model(repo: Path, name: str, config: str, source: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(source)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("deadline-sources") / "models"
    for name, config in SLOW.items():
        models.slow_python(repo, name, config)
    for name, config in PROBES.items():
        _python_model(repo, name, config, DEADLINE_PROBE)
    _python_model(repo, "bls_caller", BLS_CONFIG, BLS_CALLER)
    for ensemble in ENSEMBLES:
        ensemble.write(repo)
    with geserve([repo], tmp_path_factory.mktemp("deadline-sources-log") / "geserve.log") as running:
        try:
            yield running
        finally:
            _close_clients()
    if LATENCIES:
        print("\ndeadline answers (ms from just before sending):")
        for case, seconds in LATENCIES:
            print(f"  {case:<48} {seconds * 1000:6.1f}")


# One client of each kind per module, warmed up (connected) before any timed call: a first call's connection set-up
# is no part of the deadline's answer. tritonclient's HTTP client must be closed on the main thread (conftest).
_clients: dict[str, object] = {}


def _close_clients() -> None:
    for client in _clients.values():
        client.close()  # type: ignore[attr-defined]
    _clients.clear()
    gc.collect()


def http(server: RunningServer) -> httpclient.InferenceServerClient:
    client = _clients.get("http")
    if client is None:
        client = _clients["http"] = httpclient.InferenceServerClient(
            server.url, connection_timeout=CALL_TIMEOUT_S, network_timeout=CALL_TIMEOUT_S)
        assert client.is_server_live()
    return client  # type: ignore[return-value]


def grpc(server: RunningServer) -> grpcclient.InferenceServerClient:
    client = _clients.get("grpc")
    if client is None:
        client = _clients["grpc"] = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.is_server_live(client_timeout=CALL_TIMEOUT_S)
    return client  # type: ignore[return-value]


def grpc_infer(client: grpcclient.InferenceServerClient, model: str, inputs: list,
               **kwargs: object) -> grpcclient.InferResult:
    """`client.infer` without a deadline of its own (`client_timeout` would give the request one), but never
    waiting more than CALL_TIMEOUT_S: sent with `async_infer`, its answer waited for on an event."""
    done = threading.Event()
    got: list[tuple[object, object]] = []

    def finished(result: object, error: object) -> None:
        got.append((result, error))
        done.set()

    client.async_infer(model, inputs, finished, **kwargs)  # type: ignore[arg-type]
    assert done.wait(CALL_TIMEOUT_S), f"no answer from '{model}' within {CALL_TIMEOUT_S} s"
    result, error = got[0]
    if error is not None:
        raise error  # type: ignore[misc]
    return result  # type: ignore[return-value]


def tensors(module: object, named: dict[str, np.ndarray]) -> list:
    """InferInputs of `module` (tritonclient.http or .grpc) holding `named`."""
    out = []
    for name, array in named.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def slow_in(model: str, seconds: float) -> dict[str, np.ndarray]:
    shape = [1, 1] if model in BATCHED else [1]
    return {"IN": np.full(shape, seconds, np.float32)}


# ---- what the server counted -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    executions: int
    successes: int
    failures: int
    deadline_failures: int  # nv_inference_request_failure{reason="DEADLINE_EXCEEDED"}


_FAILURE = re.compile(r'^nv_inference_request_failure\{([^}]*)\} (\S+)$', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def counts(server: RunningServer, *names: str) -> dict[str, Counts]:
    """Each model's executions, successes and failures (its /stats) and DEADLINE_EXCEEDED failures (/metrics)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        metrics = response.read().decode()
    deadline_failures: dict[str, int] = {}
    for labels, value in _FAILURE.findall(metrics):
        label = dict(_LABEL.findall(labels))
        if label.get("reason") == "DEADLINE_EXCEEDED":
            deadline_failures[label["model"]] = int(float(value))
    out = {}
    for name in names:
        with urllib.request.urlopen(f"{server.base}/v2/models/{name}/stats", timeout=10) as response:
            stats = json.loads(response.read())["model_stats"][0]
        inference = stats["inference_stats"]
        out[name] = Counts(stats["execution_count"], inference["success"]["count"], inference["fail"]["count"],
                           deadline_failures[name])
    return out


def change(before: dict[str, Counts], after: dict[str, Counts]) -> dict[str, Counts]:
    return {name: Counts(*(a - b for a, b in zip(vars(after[name]).values(), vars(before[name]).values(),
                                                   strict=True))) for name in before}


def change_once(server: RunningServer, before: dict[str, Counts], expected: dict[str, Counts],
                timeout: float = 5) -> dict[str, Counts]:
    """The change since `before` once it is `expected` (an execution whose result was dropped is counted when it
    ends), or as it stands after `timeout`."""
    stop = time.monotonic() + timeout
    while True:
        delta = change(before, counts(server, *before))
        if delta == expected or time.monotonic() > stop:
            return delta
        time.sleep(0.05)


@contextlib.contextmanager
def busy(server: RunningServer, model: str, priority: int = 0) -> Iterator[None]:
    """`model`'s one instance runs a request sleeping BUSY_S throughout the block; it succeeds, waited for at the
    block's end (a gRPC client of its own, so the timed call's clients stay free)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done = threading.Event()
    outcome: list[object] = []

    def finished(result: object, error: object) -> None:
        outcome.append(error)
        done.set()

    try:
        client.async_infer(model, tensors(grpcclient, slow_in(model, BUSY_S)), finished, priority=priority)
        time.sleep(SETTLE_S)
        yield
        assert done.wait(CALL_TIMEOUT_S), "the busy request never finished"
    finally:
        client.close()
    assert outcome == [None], outcome


def timed(case: str, call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """What `call` raised (None: nothing) and how long it took, from just before it."""
    started = time.monotonic()
    try:
        call()
    except InferenceServerException as exc:
        error: BaseException | None = exc
    else:
        error = None
    waited = time.monotonic() - started
    LATENCIES.append((case, waited))
    return error, waited


def assert_answered_at(error: BaseException | None, waited: float, status: str | None, message: str,
                       due: float = DEADLINE_S) -> None:
    """The error `status` (HTTP's "504", gRPC's "StatusCode.DEADLINE_EXCEEDED", None on a stream, whose errors carry
    a message only) with `message`, answered no earlier than `due` (a caller's deadline: its delivery allowance
    before it) and within BOUND_S of it."""
    assert isinstance(error, InferenceServerException), "the request was not refused"
    assert error.status() == status, error
    assert error.message() == message, error
    earliest = due - delivery_allowance(due) if message.endswith(DEADLINE_ERROR) else due
    assert earliest <= waited < due + BOUND_S, f"answered after {waited * 1000:.1f} ms"


def assert_never_ran(delta: dict[str, Counts], model: str) -> None:
    """The busy request ran and succeeded; the timed one never ran, and failed once, as DEADLINE_EXCEEDED."""
    assert delta[model] == Counts(executions=1, successes=1, failures=1, deadline_failures=1), delta[model]


# ---- 1. a request queued behind a slow model, over each protocol ----------------------------------------------------


@dataclass(frozen=True)
class Way:
    """How a request gets its 50 ms (`call`, which sends it) and what answers it there."""

    call: Callable[[RunningServer, str, np.ndarray, int], Callable[[], object]]
    status: str
    message: str


def _http_timeout(server: RunningServer, model: str, value: np.ndarray, us: int) -> Callable[[], object]:
    inputs = tensors(httpclient, {"IN": value})
    return lambda: http(server).infer(model, inputs, timeout=us)


def _http_deadline(server: RunningServer, model: str, value: np.ndarray, us: int) -> Callable[[], object]:
    inputs = tensors(httpclient, {"IN": value})
    return lambda: http(server).infer(model, inputs, headers={HTTP_DEADLINE: str(us // 1000)})


def _grpc_deadline(server: RunningServer, model: str, value: np.ndarray, us: int) -> Callable[[], object]:
    inputs = tensors(grpcclient, {"IN": value})
    return lambda: grpc(server).infer(model, inputs, client_timeout=us / 1e6)


def _grpc_timeout(server: RunningServer, model: str, value: np.ndarray, us: int) -> Callable[[], object]:
    inputs = tensors(grpcclient, {"IN": value})
    return lambda: grpc_infer(grpc(server), model, inputs, timeout=us)


WAYS = {
    # queue timeouts: Triton's answer
    "http_timeout": Way(_http_timeout, "503", TIMEOUT_ERROR),
    "grpc_timeout": Way(_grpc_timeout, "StatusCode.UNAVAILABLE", TIMEOUT_ERROR),
    # the caller's deadline (the gRPC client's own deadline answers with the same code and words)
    "http_deadline": Way(_http_deadline, "504", DEADLINE_ERROR),
    "grpc_deadline": Way(_grpc_deadline, "StatusCode.DEADLINE_EXCEEDED", DEADLINE_ERROR),
}
DEADLINES = ["http_deadline", "grpc_deadline"]


def sent(way: str, server: RunningServer, model: str, seconds: float = 0.0, us: int = DEADLINE_US
         ) -> Callable[[], object]:
    """The call sending `model` a request sleeping `seconds` with `us` µs of `way`, both clients connected."""
    call = WAYS[way].call(server, model, slow_in(model, seconds)["IN"], us)
    http(server), grpc(server)  # connected before the clock starts
    return call


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("model", ["slow_batched", "slow_direct"])
def test_a_queued_request_is_answered_at_its_deadline_and_never_runs(
    server: RunningServer, model: str, way: str
) -> None:
    """HTTP's and gRPC's `timeout` parameter (a queue timeout: 503 / UNAVAILABLE "Request timeout expired"), the
    HTTP gateway's deadline header and gRPC's deadline (504 / DEADLINE_EXCEEDED): each answers the request queued
    behind the busy model within 60 ms; the model never runs it, and counts it once as DEADLINE_EXCEEDED."""
    call = sent(way, server, model)
    before = counts(server, model)
    with busy(server, model):
        error, waited = timed(f"{way} {model}", call)
    assert_answered_at(error, waited, WAYS[way].status, WAYS[way].message)
    assert_never_ran(change(before, counts(server, model)), model)


@pytest.mark.parametrize("model", ["slow_batched", "slow_direct"])
def test_a_streamed_request_is_answered_at_its_deadline_and_the_stream_goes_on(
    server: RunningServer, model: str
) -> None:
    """On a gRPC stream, the `timeout` parameter: the queue timeout's error comes back on the stream within 60 ms,
    the model never runs the request, and the same stream then serves the next request."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: list[tuple[float, object, object]] = []
    arrived = threading.Condition()

    def callback(result: object, error: object) -> None:
        with arrived:
            answers.append((time.monotonic(), result, error))
            arrived.notify_all()

    def next_answer() -> tuple[float, object, object]:
        with arrived:
            assert arrived.wait_for(lambda: answers, timeout=CALL_TIMEOUT_S), "no answer on the stream"
            return answers.pop(0)

    client.start_stream(callback)
    try:
        client.async_stream_infer(model, tensors(grpcclient, slow_in(model, 0.0)))  # the stream is open and warm
        assert next_answer()[2] is None
        before = counts(server, model)
        with busy(server, model):
            inputs = tensors(grpcclient, slow_in(model, 0.0))
            started = time.monotonic()
            client.async_stream_infer(model, inputs, timeout=DEADLINE_US)
            answered, result, error = next_answer()
            LATENCIES.append((f"grpc_stream timeout {model}", answered - started))
        assert result is None
        assert_answered_at(error, answered - started, None, TIMEOUT_ERROR)  # type: ignore[arg-type]
        assert_never_ran(change(before, counts(server, model)), model)

        client.async_stream_infer(model, tensors(grpcclient, slow_in(model, 0.25)))  # the stream goes on
        _, result, error = next_answer()
        assert error is None
        assert result.as_numpy("OUT").ravel().tolist() == [0.5]  # type: ignore[attr-defined]
    except BaseException:
        client.stop_stream(cancel_requests=True)  # else stop_stream waits for every request sent to be answered
        raise
    finally:
        client.close()


# ---- known bugs: both fixes are needed together ----------------------------------------------------------------------

# ---- 2. inside an ensemble step, and from a BLS call -----------------------------------------------------------------


@pytest.mark.parametrize(("ensemble", "way"), [
    (ensemble, way) for ensemble in ("ens_direct", "ens_batched") for way in WAYS])
def test_an_ensemble_step_queued_behind_its_busy_model_is_answered_at_the_deadline(
    server: RunningServer, ensemble: str, way: str
) -> None:
    """The ensemble's deadline (gRPC's, the HTTP header's) is its steps': the step waiting for the busy model is
    withdrawn at 50 ms and never runs, and the ensemble is answered DEADLINE_EXCEEDED / 504 within 60 ms. Its
    `timeout` is each step's own queue timeout (Triton passes it to every step): the step times out in its queue at
    50 ms and fails the ensemble with its code and words in the ensemble's name (UNAVAILABLE / 503, "in ensemble
    '...', Request timeout expired"). The step counts it once as DEADLINE_EXCEEDED, and so does the ensemble where
    its own deadline passed, else as a failure of its step (OTHER, as Triton counts those)."""
    step = STEP_OF[ensemble]
    call = sent(way, server, ensemble)
    before = counts(server, ensemble, step)
    with busy(server, step):
        error, waited = timed(f"{way} {ensemble}", call)
    queued = way.endswith("_timeout")
    message = f"in ensemble '{ensemble}', {TIMEOUT_ERROR}" if queued else WAYS[way].message
    assert_answered_at(error, waited, WAYS[way].status, message)
    delta = change(before, counts(server, ensemble, step))
    assert_never_ran(delta, step)
    assert delta[ensemble] == Counts(executions=0, successes=0, failures=1, deadline_failures=int(not queued)), \
        delta[ensemble]


def test_a_steps_own_queue_timeout_fails_its_ensemble(server: RunningServer) -> None:
    """A step whose model's queue policy times it out (50 ms, no parameter, no deadline anywhere) fails its ensemble
    as Triton's step errors do: the ensemble is answered with the step's code and words, in the ensemble's name
    ("in ensemble 'ens_policy', Request timeout expired", HTTP 503), within 60 ms; the step never runs and counts it
    as DEADLINE_EXCEEDED, the ensemble as a failure of its step (OTHER, as Triton counts them)."""
    ensemble, step = "ens_policy", "slow_policy"
    inputs = tensors(httpclient, slow_in(ensemble, 0.0))
    http(server)
    before = counts(server, ensemble, step)
    with busy(server, step, priority=2):
        error, waited = timed(f"http step queue policy {ensemble}", lambda: http(server).infer(ensemble, inputs))
    assert_answered_at(error, waited, "503", f"in ensemble '{ensemble}', {TIMEOUT_ERROR}")
    delta = change(before, counts(server, ensemble, step))
    assert_never_ran(delta, step)
    assert delta[ensemble] == Counts(executions=0, successes=0, failures=1, deadline_failures=0), delta[ensemble]


def bls(server: RunningServer, target: str, shape: list[int], timeout_us: int) -> dict[str, object]:
    """What bls_caller saw of its BLS call to `target` (sent over HTTP, no deadline of its own)."""
    result = http(server).infer("bls_caller", tensors(httpclient, {
        "TARGET": np.array([target.encode()], np.object_),
        "SHAPE": np.array(shape, np.int64),
        "TIMEOUT_US": np.array([timeout_us], np.int64),
    }))
    return {name: result.as_numpy(name).ravel()[0] for name in ("ERROR", "CODE", "ELAPSED_MS", "LEFT")}


@pytest.mark.parametrize("target", ["slow_batched", "slow_direct"])
def test_a_bls_call_with_a_timeout_is_answered_at_its_deadline_and_never_runs(
    server: RunningServer, target: str
) -> None:
    """`pb_utils.InferenceRequest(..., timeout=50000)` to the busy model, a queue timeout: exec() gives back Triton's
    UNAVAILABLE "Request timeout expired" within 60 ms, and the target never runs the request."""
    http(server)
    before = counts(server, target, "bls_caller")
    with busy(server, target):
        seen = bls(server, target, list(slow_in(target, 0.0)["IN"].shape), DEADLINE_US)
    LATENCIES.append((f"bls timeout {target} (inside the model)", float(seen["ELAPSED_MS"]) / 1000))  # type: ignore[arg-type]
    assert seen["ERROR"] == TIMEOUT_ERROR.encode(), seen
    assert seen["CODE"] == 4, seen  # TritonError.UNAVAILABLE, as Triton's timed-out request
    assert DEADLINE_S * 1000 <= seen["ELAPSED_MS"] < (DEADLINE_S + BOUND_S) * 1000, seen  # type: ignore[operator]
    delta = change(before, counts(server, target, "bls_caller"))
    assert_never_ran(delta, target)
    assert delta["bls_caller"] == Counts(executions=1, successes=1, failures=0, deadline_failures=0)


# ---- 3. a caller's deadline holds while the request runs ------------------------------------------------------------


@pytest.mark.parametrize("way", DEADLINES)
@pytest.mark.parametrize("model", ["slow_batched", "slow_direct", "ens_direct", "ens_batched"])
def test_a_request_running_past_its_deadline_is_answered_at_it(server: RunningServer, model: str, way: str) -> None:
    """A request the idle model starts at once, whose execution (0.5 s) outlasts the caller's deadline (gRPC's
    0.2 s, the HTTP header's 200 ms): answered DEADLINE_EXCEEDED / 504 within 10 ms of the deadline, not with the
    result 0.3 s late; the execution runs to its end, its result is dropped, and the request is counted once, as
    DEADLINE_EXCEEDED (by its ensemble too)."""
    step = STEP_OF.get(model, model)
    names = (model, step) if step != model else (model,)
    call = sent(way, server, model, RUNNING_S, int(LIFE_S * 1e6))
    before = counts(server, *names)
    error, waited = timed(f"{way} {model} (running)", call)
    assert_answered_at(error, waited, WAYS[way].status, WAYS[way].message, due=LIFE_S)
    expected = {step: Counts(executions=1, successes=0, failures=1, deadline_failures=1)}
    if step != model:
        expected[model] = Counts(executions=0, successes=0, failures=1, deadline_failures=1)
    assert change_once(server, before, expected) == expected


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(("model", "timeout_us"), [
    ("slow_policy", 0), ("slow_batched", DEADLINE_US), ("slow_direct", DEADLINE_US),
    ("ens_direct", DEADLINE_US), ("ens_batched", DEADLINE_US)])
def test_a_request_started_before_its_queue_timeout_runs_to_completion(
    server: RunningServer, model: str, timeout_us: int, protocol: str
) -> None:
    """A request its model starts at once (nothing queued) runs to the end and succeeds even when that takes longer
    than its 50 ms queue timeout (the queue policy's default, the `timeout` parameter, an ensemble's, which its step
    takes), as in Triton: the timeout bounds the wait in the queue, not the execution."""
    step = STEP_OF.get(model, model)
    names = (model, step) if step != model else (model,)
    before = counts(server, *names)
    if protocol == "http":
        inputs = tensors(httpclient, slow_in(model, 0.125))
        result = http(server).infer(model, inputs, timeout=timeout_us or None)
    else:
        inputs = tensors(grpcclient, slow_in(model, 0.125))
        result = grpc_infer(grpc(server), model, inputs, timeout=timeout_us or None)
    assert result.as_numpy("OUT").ravel().tolist() == [0.25]
    delta = change(before, counts(server, *names))
    assert delta[step] == Counts(executions=1, successes=1, failures=0, deadline_failures=0), delta
    if step != model:
        assert delta[model] == Counts(executions=1, successes=1, failures=0, deadline_failures=0), delta


# ---- 4. every queue timeout source ----------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_queue_policys_default_timeout_is_a_queue_timeout_without_any_parameter(
    server: RunningServer, protocol: str
) -> None:
    """`default_queue_policy { default_timeout_microseconds: 50000 }` (REJECT): a request with no `timeout` and no
    deadline queued behind the busy model is refused at 50 ms, as Triton refuses it (HTTP 503, gRPC UNAVAILABLE,
    "Request timeout expired")."""
    model = "slow_policy"
    if protocol == "http":
        inputs = tensors(httpclient, slow_in(model, 0.0))
        call: Callable[[], object] = lambda: http(server).infer(model, inputs)  # noqa: E731
    else:
        inputs = tensors(grpcclient, slow_in(model, 0.0))
        call = lambda: grpc_infer(grpc(server), model, inputs)  # noqa: E731
    http(server), grpc(server)
    before = counts(server, model)
    with busy(server, model, priority=2):
        error, waited = timed(f"{protocol} queue policy {model}", call)
    assert_answered_at(error, waited, "503" if protocol == "http" else "StatusCode.UNAVAILABLE", TIMEOUT_ERROR)
    assert_never_ran(change(before, counts(server, model)), model)


def test_a_timeout_parameter_is_ignored_where_the_queue_policy_forbids_overriding(server: RunningServer) -> None:
    """Triton's rule: a batched model whose queue policy has `allow_timeout_override: false` ignores the request's
    `timeout`, so the request waits for the busy model and runs. (An unbatched model honours it:
    test_a_queued_request_is_answered_at_its_deadline_and_never_runs[slow_direct-*_timeout].)"""
    model = "slow_no_override"
    inputs = tensors(httpclient, slow_in(model, 0.125))
    http(server)
    before = counts(server, model)
    with busy(server, model):
        started = time.monotonic()
        result = http(server).infer(model, inputs, timeout=DEADLINE_US)
        waited = time.monotonic() - started
    assert result.as_numpy("OUT").ravel().tolist() == [0.25]
    assert waited > BUSY_S - SETTLE_S - 0.05  # it waited for the busy request
    delta = change(before, counts(server, model))
    assert delta[model] == Counts(executions=2, successes=2, failures=0, deadline_failures=0), delta[model]


# ---- 5. what a Python model sees: request.deadline() -----------------------------------------------------------------


def _probe_in(model: str) -> dict[str, np.ndarray]:
    return {"IN": np.zeros([1, 1] if model == "probe_policy" else [1], np.float32)}


def left_http(server: RunningServer, model: str, **kwargs: object) -> tuple[float, float]:
    """LEFT as `model` saw it, asked over HTTP, and the call's round trip."""
    inputs = tensors(httpclient, _probe_in(model))
    started = time.monotonic()
    result = http(server).infer(model, inputs, **kwargs)  # type: ignore[arg-type]
    return float(result.as_numpy("LEFT").ravel()[0]), time.monotonic() - started


def left_grpc(server: RunningServer, model: str, **kwargs: object) -> tuple[float, float]:
    """As `left_http`, over gRPC: with `client_timeout` a call with that deadline, else one without any."""
    inputs = tensors(grpcclient, _probe_in(model))
    started = time.monotonic()
    if "client_timeout" in kwargs:
        result = grpc(server).infer(model, inputs, **kwargs)  # type: ignore[arg-type]
    else:
        result = grpc_infer(grpc(server), model, inputs, **kwargs)
    return float(result.as_numpy("LEFT").ravel()[0]), time.monotonic() - started


def assert_left(left: float, given_s: float, round_trip: float, grpc_timeout: bool = False) -> None:
    """The model saw the time given, less its delivery allowance and what had passed since: no more than that, no
    less than that minus the call's whole round trip. gRPC sends a deadline under a second in whole milliseconds,
    rounded up (grpc-timeout "900m" for 0.8996 s): 1 ms over is allowed there."""
    kept = given_s - delivery_allowance(given_s)
    assert kept - round_trip <= left <= kept + (0.001 if grpc_timeout else 0), (left, given_s, round_trip)


def test_a_python_model_without_a_deadline_sees_none(server: RunningServer) -> None:
    """No gRPC deadline, no HTTP deadline header: request.deadline() is None (the model answers -1)."""
    assert left_http(server, "probe_direct")[0] == -1.0
    assert left_grpc(server, "probe_direct")[0] == -1.0
    assert bls(server, "probe_direct", [1], 0)["LEFT"] == -1.0


@pytest.mark.parametrize("source", ["http_timeout", "grpc_timeout", "queue_policy", "bls_timeout"])
def test_a_queue_timeout_is_no_deadline_inside_execute(server: RunningServer, source: str) -> None:
    """A queue timeout (the `timeout` parameter over HTTP and gRPC, the queue policy's default timeout, a BLS call's
    `timeout=`) no longer applies once the model has the request: request.deadline() is None there."""
    if source == "http_timeout":
        left = left_http(server, "probe_direct", timeout=900_000)[0]
    elif source == "grpc_timeout":
        left = left_grpc(server, "probe_direct", timeout=900_000)[0]
    elif source == "queue_policy":
        left = left_http(server, "probe_policy")[0]
    else:
        seen = bls(server, "probe_direct", [1], 300_000)
        assert seen["ERROR"] == b"", seen
        left = float(seen["LEFT"])  # type: ignore[arg-type]
    assert left == -1.0


@pytest.mark.parametrize("source", ["grpc_deadline", "http_deadline", "ensemble_grpc", "ensemble_http", "both"])
def test_a_python_model_sees_the_time_it_has_left(server: RunningServer, source: str) -> None:
    """request.deadline() is the seconds left of the caller's deadline, whatever set it: gRPC's deadline, the HTTP
    gateway's header, or the ensemble request the step belongs to; a `timeout` sent with it changes nothing."""
    given = 0.9  # under a second: grpc-timeout carries it to the millisecond
    header = {HTTP_DEADLINE: str(int(given * 1000))}
    if source == "grpc_deadline":
        left, round_trip = left_grpc(server, "probe_direct", client_timeout=given)
    elif source == "http_deadline":
        left, round_trip = left_http(server, "probe_direct", headers=header)
    elif source == "ensemble_grpc":
        left, round_trip = left_grpc(server, "ens_probe", client_timeout=given)
    elif source == "ensemble_http":
        left, round_trip = left_http(server, "ens_probe", headers=header)
    else:
        left, round_trip = left_http(server, "probe_direct", headers=header, timeout=300_000)
    assert_left(left, given, round_trip, grpc_timeout=source in ("grpc_deadline", "ensemble_grpc"))


# ---- the timer itself ------------------------------------------------------------------------------------------------


def _nothing() -> None:
    """A withdrawal with nothing to take back."""


def test_a_watch_is_armed_only_once_bound() -> None:
    """A request its scheduler did not take (`schedule` returned None: it runs in a task, watched there) is never
    answered by the watch made for it: the timer starts only when `bind` hands it the request's withdrawal."""
    async def calls() -> list[object]:
        answered: list[object] = []
        Watched(answered.append, _request(deadline=time.monotonic() + 0.005))
        await asyncio.sleep(0.03)
        return answered

    assert asyncio.run(calls()) == []


def _request(deadline: float | None = None, queue_deadline: float | None = None) -> InferenceRequest:
    request = InferenceRequest("m", "", [])
    request.deadline, request.queue_deadline = deadline, queue_deadline
    return request


@pytest.mark.parametrize("kind", ["deadline", "queue_deadline"])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_deadline_timer_never_answers_before_the_deadline(loop: str, kind: str) -> None:
    """`Watched` answers at the deadline (DEADLINE_EXCEEDED) or the queue deadline (Triton's UNAVAILABLE), never
    before it, on the server's loop (uvloop, whose timers count whole milliseconds and may run up to one early) as on
    asyncio's: a request withdrawn early would be counted CANCELED, not DEADLINE_EXCEEDED (the service tells them
    apart by whether a deadline has passed). The timer reads the deadline from the request: one without any is
    never answered (this test hung when it set none)."""
    expected: type[GeserveError] = DeadlineExceededError if kind == "deadline" else QueueTimeoutError

    async def early_answers() -> list[float]:
        early = []
        for i in range(40):
            answered = asyncio.get_running_loop().create_future()
            deadline = time.monotonic() + 0.003 + i * 0.00013  # sub-millisecond offsets
            request = _request(**{kind: deadline})
            Watched(lambda outcome, f=answered: f.set_result((time.monotonic(), outcome)), request).bind(_nothing)
            at, outcome = await asyncio.wait_for(answered, 1)
            assert isinstance(outcome, expected)
            early.append(deadline - at)
        return [e for e in early if e > 0]

    run = uvloop.run if loop == "uvloop" else asyncio.run
    assert run(early_answers()) == []


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_started_requests_timer_waits_for_its_deadline_only(loop: str) -> None:
    """Once the request starts (the instance pool clears its queue deadline), the queue deadline answers nothing: the
    timer armed for it waits for the caller's deadline, or, without one, answers nothing at all."""
    async def outcomes() -> tuple[float, object, bool]:
        now = time.monotonic()
        answered = asyncio.get_running_loop().create_future()
        request = _request(deadline=now + 0.02, queue_deadline=now + 0.005)
        Watched(lambda outcome: answered.set_result((time.monotonic(), outcome)), request).bind(_nothing)
        request.queue_deadline = None  # started
        at, outcome = await asyncio.wait_for(answered, 1)

        queued_only = _request(queue_deadline=time.monotonic() + 0.005)
        calls: list[object] = []
        Watched(calls.append, queued_only).bind(_nothing)
        queued_only.queue_deadline = None
        await asyncio.sleep(0.03)
        return at - (now + 0.02), outcome, not calls

    run = uvloop.run if loop == "uvloop" else asyncio.run
    late, outcome, silent = run(outcomes())
    assert isinstance(outcome, DeadlineExceededError) and late >= 0
    assert silent
