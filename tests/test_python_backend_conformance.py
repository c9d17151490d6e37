"""Side by side: the same Python models (tests/support/python_models), unchanged, on geserve and the real Triton.

Outputs, error statuses and messages, the auto-completed config, initialize()'s args and a decoupled model's
gRPC stream must agree. Deliberate differences, asserted where they show:

- the model file paths inside error messages (each server has its own copy of the repository);
- a BLS call to a missing model: both return the error in the response; the wording differs (Triton: "Model
  no_such_model - Error when running inference: ... is not ready", geserve: "Request for unknown model: ...");
- statistics after failures (geserve counts a model's error response as a failed request; Triton as a success).
"""

from __future__ import annotations

import json
import queue
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.ensembles import repeat_inc
from tests.support.python_repo import geserve_repository, triton_repository
from tests.support.reference import BootingTriton, reference_available, reference_unavailable_reason
from tests.support.server import geserve
from tests.support.streams import outputs_of, stream_request

pytestmark = pytest.mark.reference
NEWER_CONFIG_FIELDS = {"runtime", "is_non_linear_format_io"}  # in Triton 2.51's model_config.proto, not in geserve's


@dataclass(frozen=True)
class Target:
    http: str  # host:port
    grpc: str
    repo: Path

    def clean(self, text: str) -> str:
        return text.replace(str(self.repo), "<repo>")


@dataclass(frozen=True)
class Pair:
    geserve: Target
    triton: Target

    def __iter__(self) -> Iterator[Target]:
        return iter((self.geserve, self.triton))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    if not reference_available():
        pytest.skip(reference_unavailable_reason() or "reference Triton unavailable")
    root = tmp_path_factory.mktemp("python-conformance")
    triton_repo = triton_repository(root / "triton").resolve()
    geserve_repo = geserve_repository(root / "geserve")
    for repo in (triton_repo, geserve_repo):
        repeat_inc().write(repo)
    triton = BootingTriton(triton_repo, root)
    try:
        with geserve([geserve_repo], root / "geserve.log") as server:
            triton.wait()
            yield Pair(Target(server.url, server.grpc_url, geserve_repo), Target(triton.http, triton.grpc, triton_repo))
    finally:
        triton.stop()


def _input(name: str, array: np.ndarray, datatype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def infer(target: Target, model: str, inputs: list[tuple[str, np.ndarray, str]]) -> dict | tuple[str, str]:
    """Every output as numpy, or (status, message) of the error."""
    client = httpclient.InferenceServerClient(target.http)
    try:
        result = client.infer(model, [_input(*i) for i in inputs])
    except InferenceServerException as exc:
        return str(exc.status()), target.clean(exc.message())
    finally:
        client.close()
    return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}


def without_newer_fields(value):
    if isinstance(value, dict):
        return {k: without_newer_fields(v) for k, v in value.items() if k not in NEWER_CONFIG_FIELDS}
    if isinstance(value, list):
        return [without_newer_fields(v) for v in value]
    return value


def get_json(target: Target, path: str) -> dict:
    with urllib.request.urlopen(f"http://{target.http}{path}", timeout=10) as response:
        return json.loads(response.read())


ADD_SUB = [
    ("INPUT0", np.array([1, 2, 3, 4], np.float32), "FP32"),
    ("INPUT1", np.array([0.5, 1, 1, 9], np.float32), "FP32"),
]


def identity_inputs(text: bytes, values: list[float]) -> list[tuple[str, np.ndarray, str]]:
    return [
        ("TEXT", np.array([[text, b"\x00\xffraw"]], dtype=np.object_), "BYTES"),
        ("VALUES", np.array([values], np.float32), "FP32"),
    ]


def test_outputs_match(pair: Pair) -> None:
    ge, triton = (infer(t, "add_sub", ADD_SUB) for t in pair)
    np.testing.assert_array_equal(ge["OUTPUT0"], [1.5, 3, 4, 13])
    for name in ("OUTPUT0", "OUTPUT1"):
        np.testing.assert_array_equal(ge[name], triton[name])
        assert ge[name].dtype == triton[name].dtype

    ge, triton = (infer(t, "identity", identity_inputs(b"caf\xc3\xa9", [1.5, -2])) for t in pair)
    assert ge.keys() == triton.keys() == {"TEXT_OUT", "VALUES_OUT", "REQUESTS"}
    for name in ge:
        np.testing.assert_array_equal(ge[name], triton[name])
    assert ge["TEXT_OUT"].tolist() == [[b"caf\xc3\xa9", b"\x00\xffraw"]]

    ge, triton = (infer(t, "bls", ADD_SUB) for t in pair)
    assert ge.keys() == triton.keys()
    for name in ("SUM", "DIFF", "SIMPLE", "REPEATED", "REPEAT_RESPONSES"):
        np.testing.assert_array_equal(ge[name], triton[name], err_msg=name)
    np.testing.assert_array_equal(ge["SIMPLE"], np.tile([2, 4, 6, 8], 4))
    assert ge["REPEATED"].tolist() == [5, 6, 7] and ge["REPEAT_RESPONSES"].tolist() == [4]  # 3 + the empty final
    for missing in (ge["MISSING"], triton["MISSING"]):  # the error comes back in the response
        has_error, message = missing[0].decode().split("|", 1)
        assert has_error == "True" and "no_such_model" in message


def test_errors_match(pair: Pair) -> None:
    ge, triton = (infer(t, "identity", identity_inputs(b"fail", [1])) for t in pair)
    assert ge == triton == ("400", "identity was asked to fail")

    ge, triton = (infer(t, "identity", identity_inputs(b"raise", [1])) for t in pair)
    assert ge == triton
    assert ge == ("500", "Failed to process the request(s) for model 'identity_0_0', message: ValueError: identity "
                         "was asked to raise\n\nAt:\n  <repo>/identity/1/model.py(17): execute\n")

    ge, triton = (infer(t, "repeat", [("IN", np.array([1], np.int32), "INT32")]) for t in pair)
    assert ge == triton == ("501", "HTTP end point doesn't support models with decoupled transaction policy")

    answers = []
    for target in pair:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        with pytest.raises(InferenceServerException) as caught:
            grpcclient.InferenceServerClient(target.grpc).infer("repeat", [tensor])
        answers.append((caught.value.status(), caught.value.message()))
    assert answers[0] == answers[1]
    assert answers[0] == ("StatusCode.UNIMPLEMENTED",
                          "ModelInfer RPC doesn't support models with decoupled transaction policy")


def test_auto_completed_config_and_initialize_args_match(pair: Pair) -> None:
    ge, triton = (without_newer_fields(get_json(t, "/v2/models/auto_complete/config")) for t in pair)
    assert ge == triton
    assert ge["max_batch_size"] == 4 and ge["dynamic_batching"]["preferred_batch_size"] == [4]
    assert [i["name"] for i in ge["input"]] == ["X"] and [o["name"] for o in ge["output"]] == ["Y", "ARGS"]

    x = np.array([[1, 2, 3]], np.float32)
    args = []
    for target in pair:
        outputs = infer(target, "auto_complete", [("X", x, "FP32")])
        np.testing.assert_array_equal(outputs["Y"], x * 2)
        values = json.loads(outputs["ARGS"][0][0])
        values["model_config"] = without_newer_fields(json.loads(values["model_config"]))
        values["model_repository"] = target.clean(values["model_repository"])
        args.append(values)
    assert args[0] == args[1]
    assert args[0]["model_instance_name"] == "auto_complete_0" and args[0]["model_instance_kind"] == "CPU"
    assert args[0]["model_repository"] == "<repo>/auto_complete" and args[0]["model_version"] == "1"


def stream(target: Target, requests: list[tuple[str, list[int]]], empty_final: bool, expect: int) -> list:
    """`expect` messages of one gRPC stream (each request's in order), then none more within 0.3 s."""
    received: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(target.grpc)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for request_id, values in requests:
            tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
            tensor.set_data_from_numpy(np.array(values, np.int32))
            client.async_stream_infer("repeat", [tensor], request_id=request_id,
                                      enable_empty_final_response=empty_final)
        messages = []
        for _ in range(expect):
            result, error = received.get(timeout=10)
            if error is not None:
                messages.append(("error", target.clean(error.message())))
                continue
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}
            final = response.parameters["triton_final_response"].bool_param
            messages.append((response.id, response.model_name, outputs, final))
        with pytest.raises(queue.Empty):
            received.get(timeout=0.3)
        return messages
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize(("values", "empty_final", "expect"), [
    ([1, 2], False, 2),  # the final flag sent alone is not forwarded
    ([1, 2], True, 3),  # ... unless the request asked for it: an empty response, triton_final_response=true
    ([1, -1, 2], True, 4),  # an error response in the middle of the stream
    ([-2], True, 1),  # execute() raised
    ([3, 4, -3], True, 2),  # the final flag sent with the last response
    ([], True, 1),  # only the final flag
])
def test_decoupled_stream_matches(pair: Pair, values: list[int], empty_final: bool, expect: int) -> None:
    ge, triton = (stream(t, [("r1", values)], empty_final, expect) for t in pair)
    assert ge == triton
    if values == [1, 2] and empty_final:
        assert ge == [("r1", "repeat", {"OUT": [1], "IDX": [0]}, False),
                      ("r1", "repeat", {"OUT": [2], "IDX": [1]}, False),
                      ("r1", "repeat", {}, True)]


def test_decoupled_requests_interleave_on_one_stream(pair: Pair) -> None:
    by_id = []
    for target in pair:
        messages = stream(target, [("a", [1, 2, 3]), ("b", [9])], True, 6)
        by_id.append({rid: [m for m in messages if m[0] == rid] for rid in ("a", "b")})
    assert by_id[0] == by_id[1]
    assert [m[2].get("OUT") for m in by_id[0]["a"]] == [[1], [2], [3], None]


def ensemble_stream(target: Target, values: list[int]) -> tuple[list, bool]:
    """What one request to `repeat_inc` streams back: its responses and errors in order, and whether the stream
    ended with the final flag. A final flag sent alone (an empty final response) and one sent with the last
    response read the same: when it comes is a race in both servers. An error ends the stream (nothing within
    0.5 s after it)."""
    messages, final = stream_request(target.grpc, "repeat_inc", values, request_id="e1")
    read = []
    for result, error in messages:
        if result is None:
            read.append(("error", target.clean(error)))
        elif outputs := outputs_of(result):
            response = result.get_response()
            read.append((response.id, response.model_name, outputs))
    return read, final


@pytest.mark.parametrize("values", [[1, 2, 3], [5, 99, 6], [], [7, -3], [-2]])
def test_ensemble_with_a_decoupled_step_matches(pair: Pair, values: list[int]) -> None:
    """Each response of the decoupled `repeat` runs `inc` once more; the ensemble streams each result."""
    ge, triton = (ensemble_stream(t, values) for t in pair)
    assert ge == triton
    if values == [1, 2, 3]:
        assert ge == ([("e1", "repeat_inc", {"IDX": [i], "Y": [v + 1]}) for i, v in enumerate(values)], True)


def test_an_ensemble_with_a_decoupled_step_is_decoupled(pair: Pair) -> None:
    configs = [get_json(t, "/v2/models/repeat_inc/config")["model_transaction_policy"] for t in pair]
    assert configs == [{"decoupled": True}] * 2
    refusals = [infer(t, "repeat_inc", [("IN", np.array([1], np.int32), "INT32")]) for t in pair]
    assert refusals[0] == refusals[1] == ("501", "HTTP end point doesn't support models with decoupled "
                                                 "transaction policy")


def _counts(target: Target, model: str) -> tuple[int, int, int, int]:
    stats = get_json(target, f"/v2/models/{model}/stats")["model_stats"][0]
    inference = stats["inference_stats"]
    return stats["inference_count"], stats["execution_count"], inference["success"]["count"], inference["fail"]["count"]


def _settled(target: Target, models: tuple[str, ...]) -> list[tuple[int, int, int, int]]:
    """The counts once two reads 0.2 s apart agree (at most 5 s): both servers record a request after answering."""
    counts = [_counts(target, m) for m in models]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.2)
        again = [_counts(target, m) for m in models]
        if again == counts:
            break
        counts = again
    return counts


def test_statistics_after_the_same_traffic_match(pair: Pair) -> None:
    expected = [(3, 3, 3, 0), (2, 2, 2, 0)]
    deltas = []
    for target in pair:
        before = _settled(target, ("auto_complete", "repeat"))  # an earlier test's last request may still count
        for _ in range(3):
            infer(target, "auto_complete", [("X", np.ones((1, 3), np.float32), "FP32")])
        for _ in range(2):
            stream(target, [("s", [1, 2])], True, 3)
        # Triton records a request's statistics after sending its response: read until they settle.
        deadline = time.monotonic() + 5
        while True:
            after = [_counts(target, m) for m in ("auto_complete", "repeat")]
            delta = [tuple(a - b for a, b in zip(x, y, strict=True)) for x, y in zip(after, before, strict=True)]
            if delta == expected or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        deltas.append(delta)
    assert deltas[0] == deltas[1]
    assert deltas[0] == expected
