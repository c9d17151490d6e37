"""The order of a gRPC stream's responses (ModelStreamInfer): a non-decoupled model's responses are written in the
order their requests were read, as Triton's stream_infer_handler.cc writes them, whatever order they complete in;
a decoupled model's go out as they come. First the ordering primitive alone, then tritonclient's streaming API on a
real server over both gRPC servers (the native h2 server over cleartext and over TLS, and grpc.aio over TLS), with a
Python model that answers after the delay it is asked for."""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from geserve.frontends.grpc.stream_order import InOrder
from tests.support import models
from tests.support.certs import issue, make_ca
from tests.support.python_repo import PYTHON_MODELS
from tests.support.server import RunningServer, geserve

TIMEOUT = 30.0

# ---- the primitive ------------------------------------------------------------------------------------------------


def test_responses_are_released_in_turn_order() -> None:
    sent: list[str] = []
    order = InOrder(sent.append)
    a, b, c = order.turn(), order.turn(), order.turn()
    order.done(c, ["c"])
    order.done(b, ["b1", "b2"])
    assert sent == []  # both wait for `a`
    order.done(a, ["a"])
    assert sent == ["a", "b1", "b2", "c"]


def test_a_response_known_at_once_waits_behind_a_running_turn_and_goes_at_once_otherwise() -> None:
    sent: list[str] = []
    order = InOrder(sent.append)
    order.now("first")
    assert sent == ["first"]
    slow = order.turn()
    order.now("behind")
    assert sent == ["first"]
    order.done(slow, [])  # no response (it only gives its turn up): the one behind it goes
    assert sent == ["first", "behind"]
    order.now("last")
    assert sent == ["first", "behind", "last"]


# ---- tritonclient against a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream_order_repo")
    shutil.copytree(PYTHON_MODELS / "sleep", root / "sleep", ignore=shutil.ignore_patterns("__pycache__"))
    decoupled = root / "sleep_decoupled"
    shutil.copytree(PYTHON_MODELS / "sleep", decoupled, ignore=shutil.ignore_patterns("__pycache__"))
    config = (decoupled / "config.pbtxt").read_text().replace('name: "sleep"', 'name: "sleep_decoupled"')
    (decoupled / "config.pbtxt").write_text(config + "model_transaction_policy { decoupled: true }\n")
    models.simple(root)
    return root


@pytest.fixture(scope="module", params=["native", "native over TLS", "grpc.aio over TLS"])
def served(request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[RunningServer, dict[str, Any]]]:
    """A server and the client arguments that reach it: plaintext gRPC or TLS on the native h2 server, or TLS on
    grpc.aio (`--grpc-server grpcio`)."""
    logs = tmp_path_factory.mktemp("stream_order_logs")
    if request.param == "native":
        with geserve([repo], logs / "server.log") as running:
            yield running, {}
        return
    ca = make_ca().write(logs, "ca")
    server = issue(ca, "geserve server", server=True).write(logs, "server")
    args = ["--grpc-use-ssl=true", f"--grpc-server-cert={server.cert_path}", f"--grpc-server-key={server.key_path}"]
    if request.param == "grpc.aio over TLS":
        args += ["--grpc-server", "grpcio"]
    with geserve([repo], logs / "server.log", args) as running:
        yield running, {"ssl": True, "root_certificates": str(ca.cert_path)}


def _stream(served: tuple[RunningServer, dict[str, Any]], requests: list[tuple[str, str, int]]) -> list[Any]:
    """Send (request id, model, value) on one stream; the answers (result or error) in the order they came."""
    server, tls = served
    client = grpcclient.InferenceServerClient(server.grpc_url, **tls)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    try:
        for request_id, model, value in requests:
            client.async_stream_infer(model, _inputs(model, value), request_id=request_id)
        return [answers.get(timeout=TIMEOUT) for _ in requests]
    finally:
        client.stop_stream()
        client.close()


def _inputs(model: str, value: int) -> list[grpcclient.InferInput]:
    if model == "simple":
        data = np.full((1, 16), value, dtype=np.int32)
        tensors = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor in tensors:
            tensor.set_data_from_numpy(data)
        return tensors
    tensor = grpcclient.InferInput("MS", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
    return [tensor]


def _id(answer: tuple[Any, Any]) -> str:
    result, error = answer
    if error is not None:
        return f"error: {error.message()}"
    return str(result.get_response().id)


def test_non_decoupled_responses_keep_request_order(served: tuple[RunningServer, dict[str, Any]]) -> None:
    # The first completes last, the second first: each response still goes out in its request's place, an error
    # and an ONNX model's response (perhaps answered as the request arrives) included.
    answers = _stream(served, [("slow", "sleep", 800), ("fast", "sleep", 0), ("onnx", "simple", 3),
                               ("unknown", "nope", 0), ("middle", "sleep", 300)])
    assert [_id(a) for a in answers] == [
        "slow", "fast", "onnx", "error: Request for unknown model: 'nope' is not found", "middle"]
    sleeps = [int(result.as_numpy("OUT")[0]) for result, error in answers if error is None and
              result.get_response().model_name == "sleep"]
    assert sleeps == [800, 0, 300]


def test_decoupled_responses_go_out_as_they_come(served: tuple[RunningServer, dict[str, Any]]) -> None:
    # Triton queues only non-decoupled requests for their turn: a decoupled response is not held behind a slower
    # request read before it, of either kind.
    answers = _stream(served, [("held", "sleep", 800), ("slow", "sleep_decoupled", 500),
                               ("free", "sleep_decoupled", 0)])
    assert [_id(a) for a in answers] == ["free", "slow", "held"]
