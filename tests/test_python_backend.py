"""The Python backend on geserve alone: async execute, instances in parallel, failures, BLS, decoupled streams,
dynamic batching, statistics, and the pb_utils API itself (tests/support/python_models, plus broken models)."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve import InferenceRequest, InputTensor, Server, ServerSettings
from tests.support.python_repo import SHARED, geserve_repository, isolate
from tests.support.server import RunningServer, geserve
from tests.support.streams import stream_request, summarized

BROKEN = {
    "broken_syntax": "class TritonPythonModel:\n    def execute(self, requests)\n        return []\n",
    "init_fails": (
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('no weights for ' + args['model_name'])\n"
        "    def execute(self, requests):\n"
        "        return []\n"
    ),
}
_CONFIG = """backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module", params=["in-process", "isolated"])
def repo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The models in the server's process, then each instance in a process of its own (`isolation: process`):
    everything below holds for both."""
    root = geserve_repository(tmp_path_factory.mktemp("python") / "models", (*SHARED, "probe", "readiness"))
    for name, source in BROKEN.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(_CONFIG)
        (root / name / "1" / "model.py").write_text(source)
    return isolate(root) if request.param == "isolated" else root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with geserve([repo], tmp_path_factory.mktemp("python-logs") / "geserve.log") as running:
        yield running
        client = _clients.pop(running.url, None)
        if client is not None:
            client.close()
            del client
            gc.collect()  # tritonclient's __del__ must run on this thread: its gevent pool cannot be joined elsewhere


# One HTTP client per server for the whole module: short-lived ones would be garbage-collected later on whatever
# thread happens to run the collector (the in-process server's, say), where tritonclient cannot close them.
_clients: dict[str, httpclient.InferenceServerClient] = {}


def http_infer(server: RunningServer, model: str, inputs: list[tuple[str, np.ndarray, str]]):
    client = _clients.get(server.url)
    if client is None:
        client = _clients[server.url] = httpclient.InferenceServerClient(
            server.url, connection_timeout=30, network_timeout=30
        )
    tensors = []
    for name, array, datatype in inputs:
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.infer(model, tensors)


def get_json(server: RunningServer, path: str, body: bytes | None = None) -> object:
    with urllib.request.urlopen(urllib.request.Request(server.base + path, data=body), timeout=10) as response:
        return json.loads(response.read())


def probe(server: RunningServer, ms: int) -> str:
    result = http_infer(server, "probe", [("MS", np.array([ms], np.int32), "INT32")])
    return result.as_numpy("INSTANCE")[0].decode()


def test_async_execute_runs_two_instances_in_parallel(server: RunningServer) -> None:
    probe(server, 0)  # warm both paths
    sleep = httpclient.InferInput("MS", [1], "INT32")
    sleep.set_data_from_numpy(np.array([500], np.int32))
    with httpclient.InferenceServerClient(server.url, concurrency=2) as client:
        started = time.monotonic()
        pending = [client.async_infer("probe", [sleep]) for _ in range(2)]
        names = [request.get_result(timeout=30).as_numpy("INSTANCE")[0].decode() for request in pending]
        elapsed = time.monotonic() - started
    assert sorted(names) == ["probe_0_0:CPU", "probe_0_1:CPU"]  # one request on each instance
    assert elapsed < 0.9, f"two 0.5 s executions took {elapsed:.2f} s: the instances did not run in parallel"


def test_exception_in_execute_fails_the_request_and_the_server_stays_up(server: RunningServer, repo: Path) -> None:
    with pytest.raises(InferenceServerException) as caught:
        probe(server, -5)
    assert caught.value.status() == "500"
    message = caught.value.message()
    assert message.startswith("Failed to process the request(s) for model 'probe_0_")
    assert "ValueError: negative sleep -5" in message and f"{repo}/probe/1/model.py(" in message
    assert "): execute\n" in message
    assert probe(server, 0).startswith("probe_0_")


def test_bad_model_files_are_unavailable_with_the_reason(server: RunningServer) -> None:
    index = {e["name"]: e for e in get_json(server, "/v2/repository/index", b"{}")}
    syntax, init = index["broken_syntax"], index["init_fails"]
    assert syntax["state"] == "UNAVAILABLE" and "SyntaxError" in syntax["reason"]
    assert "broken_syntax/1/model.py" in syntax["reason"]
    assert init["state"] == "UNAVAILABLE"
    assert "RuntimeError: no weights for init_fails" in init["reason"] and "initialize" in init["reason"]
    assert all(index[name]["state"] == "READY" for name in (*SHARED, "probe", "simple"))


def test_model_readiness_asks_the_models_own_is_ready(server: RunningServer) -> None:
    """HTTP and gRPC model readiness follow `is_ready()` (Triton's instance-ready hook); raising means not ready."""

    def set_mode(mode: int) -> None:
        http_infer(server, "readiness", [("READY", np.array([mode], np.int32), "INT32")])

    def ready() -> tuple[bool, bool]:
        with httpclient.InferenceServerClient(server.url) as http, \
                grpcclient.InferenceServerClient(server.grpc_url) as grpc:
            return http.is_model_ready("readiness"), grpc.is_model_ready("readiness")

    assert ready() == (True, True)
    try:
        set_mode(0)
        assert ready() == (False, False)
        set_mode(2)  # is_ready() raises
        assert ready() == (False, False)
        assert probe(server, 0).startswith("probe_0_")  # the rest of the server is unaffected
    finally:
        set_mode(1)
    assert ready() == (True, True)


def test_bls_reaches_ge_python_and_decoupled_models(server: RunningServer) -> None:
    a, b = np.array([1, 2, 3, 4], np.float32), np.array([4, 3, 2, 1], np.float32)
    result = http_infer(server, "bls", [("INPUT0", a, "FP32"), ("INPUT1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)  # add_sub through exec()
    np.testing.assert_array_equal(result.as_numpy("DIFF"), a - b)  # add_sub through async_exec()
    np.testing.assert_array_equal(result.as_numpy("SIMPLE"), np.tile([2, 4, 6, 8], 4))  # the ONNX model on GE
    assert result.as_numpy("MISSING")[0] == b"True|Request for unknown model: 'no_such_model' is not found"
    assert result.as_numpy("REPEATED").tolist() == [5, 6, 7]  # exec(decoupled=True) on repeat
    assert result.as_numpy("REPEAT_RESPONSES").tolist() == [4]


def test_a_decoupled_model_is_refused_over_http_and_unary_grpc(server: RunningServer) -> None:
    with pytest.raises(InferenceServerException) as caught:
        http_infer(server, "repeat", [("IN", np.array([1], np.int32), "INT32")])
    assert caught.value.status() == "501"
    assert caught.value.message() == "HTTP end point doesn't support models with decoupled transaction policy"
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException, match="ModelInfer RPC doesn't support models with decoupled"):
        grpcclient.InferenceServerClient(server.grpc_url).infer("repeat", [tensor])


def test_dynamic_batching_hands_execute_the_requests_unmerged(server: RunningServer) -> None:
    def inputs(index: int) -> list[httpclient.InferInput]:
        text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[f"request {index}".encode()]], dtype=np.object_))
        values = httpclient.InferInput("VALUES", [1, 3], "FP32")
        values.set_data_from_numpy(np.full((1, 3), index, np.float32))
        return [text, values]

    with httpclient.InferenceServerClient(server.url, concurrency=4) as client:
        pending = {index: client.async_infer("identity", inputs(index)) for index in range(4)}
        results = {index: request.get_result(timeout=30) for index, request in pending.items()}
    for index, result in results.items():
        assert result.as_numpy("TEXT_OUT").tolist() == [[f"request {index}".encode()]]  # its own rows only
        np.testing.assert_array_equal(result.as_numpy("VALUES_OUT"), np.full((1, 3), index, np.float32))
        assert result.as_numpy("REQUESTS").tolist() == [[4]]  # execute() was handed all four requests at once


def stream_messages(server: RunningServer, values: list[int]) -> list:
    """One request to `repeat`: (outputs, final) each, or ("error", message)."""
    return summarized(stream_request(server.grpc_url, "repeat", values, request_id="x", timeout=10)[0])


def test_a_stream_ends_with_an_error_when_the_model_drops_its_request(server: RunningServer) -> None:
    """Triton 2.51 leaves such a stream open forever; geserve ends it once request and sender are garbage."""
    dropped = ("error", "the Python model 'repeat_0_0' let go of request 'x' (and its response sender) without "
                        "sending TRITONSERVER_RESPONSE_COMPLETE_FINAL")
    assert stream_messages(server, [7, -4]) == [({"OUT": [7], "IDX": [0]}, False), dropped]  # sender dropped
    assert stream_messages(server, [-5]) == [dropped]  # execute() never even took the sender


def _counts(server: RunningServer, model: str) -> tuple[int, int, int, int]:
    stats = get_json(server, f"/v2/models/{model}/stats")["model_stats"][0]
    inference = stats["inference_stats"]
    return stats["inference_count"], stats["execution_count"], inference["success"]["count"], inference["fail"]["count"]


def test_statistics_count_known_traffic(server: RunningServer) -> None:
    models = ("add_sub", "repeat", "bls")
    before = {m: _counts(server, m) for m in models}
    a = np.ones(4, np.float32)
    for _ in range(3):
        http_infer(server, "add_sub", [("INPUT0", a, "FP32"), ("INPUT1", a, "FP32")])
    http_infer(server, "bls", [("INPUT0", a, "FP32"), ("INPUT1", a, "FP32")])  # 2 add_sub calls, 1 repeat stream
    assert stream_messages(server, [1, 2])[-1] == ({}, True)
    assert stream_messages(server, [-2])[0][0] == "error"
    after = {m: _counts(server, m) for m in models}
    delta = {m: tuple(x - y for x, y in zip(after[m], before[m], strict=True)) for m in models}
    assert delta == {"add_sub": (5, 5, 5, 0), "bls": (1, 1, 1, 0), "repeat": (3, 3, 2, 1)}


def test_model_logs_go_to_the_server_log(server: RunningServer) -> None:
    assert "add_sub initialized as add_sub_0_0" in server.log()


def test_in_process_stream_bls_and_finalize(repo: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The service directly: infer_stream yields each response, and unloading calls finalize()."""

    async def run() -> None:
        server = Server(ServerSettings(model_repositories=[repo], allow_http=False, allow_grpc=False,
                                       allow_metrics=False, model_control_mode="explicit",
                                       load_models=["repeat", "add_sub"]))
        await server.start()
        try:
            values = np.array([3, 1, 4], np.int32)
            request = InferenceRequest("repeat", "", [InputTensor("IN", "INT32", values.shape, values)])
            items = [item async for item in server.service.infer_stream(request)]
            assert [i.response.outputs[0].data.tolist() for i in items[:3]] == [[3], [1], [4]]
            assert [i.final for i in items] == [False, False, False, True] and items[3].response is None
            a = np.arange(4, dtype=np.float32)
            request = InferenceRequest("add_sub", "", [InputTensor("INPUT0", "FP32", (4,), a),
                                                       InputTensor("INPUT1", "FP32", (4,), a)])
            (item,) = [item async for item in server.service.infer_stream(request)]  # not decoupled: one, final
            assert item.final and item.response.outputs[0].data.tolist() == [0, 2, 4, 6]
        finally:
            await server.stop()

    with caplog.at_level("INFO", logger="geserve.python_model"):
        asyncio.run(run())
    assert "add_sub finalized" in caplog.text


def test_streamed_failures_count_under_their_reason(repo: Path) -> None:
    """A decoupled request that fails is counted under its error's reason (it used to be OTHER, whatever failed),
    and one whose reader leaves before the final response under CANCELED."""

    async def run() -> None:
        server = Server(ServerSettings(model_repositories=[repo], allow_http=False, allow_grpc=False,
                                       allow_metrics=False, model_control_mode="explicit", load_models=["repeat"]))
        await server.start()
        try:
            def request(*values: int) -> InferenceRequest:
                data = np.array(values, np.int32)
                return InferenceRequest("repeat", "", [InputTensor("IN", "INT32", data.shape, data)])

            items = [item async for item in server.service.infer_stream(request(-2))]  # execute() raises
            assert items[-1].final and items[-1].error is not None
            statistics = server.manager.get("repeat").statistics
            assert statistics.failures_by_reason() == {
                "REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 0, "DEADLINE_EXCEEDED": 0}
            stream = server.service.infer_stream(request(1, 2, 3))
            async for _ in stream:
                break  # the client goes away after the first response
            await stream.aclose()
            assert statistics.failures_by_reason() == {
                "REJECTED": 0, "CANCELED": 1, "BACKEND": 1, "OTHER": 0, "DEADLINE_EXCEEDED": 0}
        finally:
            await server.stop()

    asyncio.run(run())


# ---- the pb_utils API, without a server ------------------------------------------------------------------


def test_pb_utils_is_importable_under_its_triton_name() -> None:
    # No setup: importing geserve (this module did) registers the module under its Triton name.
    import triton_python_backend_utils as pb_utils

    from geserve.backends.python import triton_python_backend_utils as ours

    assert pb_utils is ours
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.float32) == 11 and pb_utils.numpy_to_triton_type(np.bytes_) == 13
    assert pb_utils.triton_to_numpy_type(8) is np.int32
    encoded = pb_utils.serialize_byte_tensor(np.array([b"ab", b"", "c"], dtype=np.object_))
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == [b"ab", b"", b"c"]
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL == 1


def test_tensor_wraps_arrays_without_copies_and_speaks_dlpack() -> None:
    import triton_python_backend_utils as pb_utils

    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("T", array)
    assert tensor.as_numpy() is array and tensor.name() == "T" and tensor.is_cpu()
    back = pb_utils.Tensor.from_dlpack("U", tensor.to_dlpack())
    assert np.shares_memory(back.as_numpy(), array)
    with pytest.raises(TypeError, match="no Triton datatype"):
        pb_utils.Tensor("C", np.zeros(2, np.complex64))


def test_auto_complete_model_config_rules() -> None:
    import triton_python_backend_utils as pb_utils

    config = pb_utils.ModelConfig({"name": "m", "max_batch_size": 2, "input": [{"name": "A", "dims": [4]}]})
    config.set_max_batch_size(8)  # the config may ask for less than the model allows
    assert config.as_dict()["max_batch_size"] == 2
    with pytest.raises(ValueError, match="configuration specified max_batch_size 2"):
        config.set_max_batch_size(1)
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})  # fills what the config left out
    assert config.as_dict()["input"] == [{"name": "A", "dims": [4], "data_type": "TYPE_FP32"}]
    with pytest.raises(ValueError, match="dims"):
        config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="missing 'dims'"):
        config.add_output({"name": "B", "data_type": "TYPE_FP32"})
    config.set_model_transaction_policy({"decoupled": True})
    assert pb_utils.using_decoupled_model_transaction_policy(config.as_dict())
