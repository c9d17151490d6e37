"""The real `tritonclient.grpc` (sync, asyncio, streaming) and perf_analyzer -i grpc against a real geserve process."""

from __future__ import annotations

import asyncio
import queue
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from geserve.frontends.grpc.health import SERVING, HealthCheckRequest, HealthCheckResponse
from tests.support import models
from tests.support.reference import perf_analyzer_path, run_perf_analyzer
from tests.support.server import RunningServer, geserve
from tests.support.shm import Region

A = np.arange(16, dtype=np.int32)[None]
B = np.full((1, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("grpc") / "models"
    models.simple(repo)
    models.nobatch(repo)
    models.digits(repo)
    for kind in ("fp16", "bool", "bytes"):
        models.identity(repo, kind)
    with geserve([repo], repo.parent / "geserve.log", ["--allow-system-shared-memory"]) as running:
        yield running


@pytest.fixture
def client(grpc_server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(grpc_server.grpc_url) as connected:
        yield connected


@pytest.fixture
def stub(grpc_server: RunningServer) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def simple_inputs(a: np.ndarray = A, b: np.ndarray = B) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = grpcclient.InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    return caught.value.code(), caught.value.details()


# ----------------------------------------------------------------------------------- health, metadata


def test_health_and_metadata(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("simple", "7")
    assert client.get_server_metadata().name == "geserve"
    meta = client.get_model_metadata("simple", as_json=True)
    assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": ["-1", "16"]}
    config = client.get_model_config("digits").config
    assert config.name == "digits" and config.max_batch_size > 0
    names = {m.name for m in client.get_model_repository_index().models}
    assert {"simple", "digits", "identity_bytes"} <= names


def test_standard_health_check(grpc_server: RunningServer) -> None:
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", HealthCheckRequest.SerializeToString,
                                    HealthCheckResponse.FromString)
        assert check(HealthCheckRequest()).status == SERVING
        assert check(HealthCheckRequest(service="inference.GRPCInferenceService")).status == SERVING
        assert status_of(check, HealthCheckRequest(service="nope"))[0] == grpc.StatusCode.NOT_FOUND


def test_errors_carry_tritons_codes(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nope", simple_inputs())
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert caught.value.message() == "Request for unknown model: 'nope' is not found"
    with pytest.raises(InferenceServerException) as caught:
        client.infer("simple", simple_inputs(A[:, :15]))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("simple")
    assert caught.value.status() == "StatusCode.UNAVAILABLE"


# ------------------------------------------------------------------------------------------ inference


def test_sync_infer_every_datatype_path(client: grpcclient.InferenceServerClient) -> None:
    result = client.infer("simple", simple_inputs(), request_id="r-1", parameters={"custom": "x"},
                          priority=1, timeout=10_000_000)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    assert result.get_response().id == "r-1"
    for model, value in (
        ("identity_bytes", np.array([[b"hello", b"", "\u00e9t\u00e9".encode()]], dtype=object)),
        ("identity_bool", np.array([[True, False, True]])),
        ("identity_fp16", np.array([[1.5, -2.25, 65504.0]], dtype=np.float16)),
    ):
        tensor = grpcclient.InferInput("INPUT0", list(value.shape), {"O": "BYTES", "b": "BOOL"}.get(
            value.dtype.kind, "FP16"))
        tensor.set_data_from_numpy(value)
        out = client.infer(model, [tensor]).as_numpy("OUTPUT0")
        assert out.tolist() == value.tolist(), model


def test_classification_returns_bytes(client: grpcclient.InferenceServerClient) -> None:
    wanted = [grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)]
    result = client.infer("simple", simple_inputs(), outputs=wanted)
    assert result.get_output("OUTPUT0").datatype == "BYTES"
    assert result.as_numpy("OUTPUT0").tolist() == [[b"18:15", b"17:14"]]


def test_typed_contents_and_mixing_refused(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="simple")
    for name, value in (("INPUT0", A), ("INPUT1", B)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(value.reshape(-1).tolist())
    response = stub.ModelInfer(request)
    assert list(response.outputs[0].shape) == [1, 16] and len(response.raw_output_contents) == 2
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.int32), (A + B)[0])
    request.raw_input_contents.append(A.tobytes())
    code, message = status_of(stub.ModelInfer, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'"
    )


def test_large_tensor_beyond_grpc_default_limits(client: grpcclient.InferenceServerClient) -> None:
    value = np.arange(24 * 1024 * 1024, dtype=np.float16)[None]  # 48 MiB each way, over gRPC's 4 MiB default
    tensor = grpcclient.InferInput("INPUT0", list(value.shape), "FP16")
    tensor.set_data_from_numpy(value)
    np.testing.assert_array_equal(client.infer("identity_fp16", [tensor]).as_numpy("OUTPUT0"), value)


def test_asyncio_client_many_in_flight(grpc_server: RunningServer) -> None:
    async def run() -> list[np.ndarray]:
        async with aioclient.InferenceServerClient(grpc_server.grpc_url) as client:
            assert await client.is_server_ready()
            results = await asyncio.gather(*(
                client.infer("simple", simple_inputs(A + k), request_id=str(k)) for k in range(32)
            ))
            return [r.as_numpy("OUTPUT0") for r in results]

    for k, output in enumerate(asyncio.run(run())):
        np.testing.assert_array_equal(output, A + k + B)


# ------------------------------------------------------------------------------------------ streaming


def _collect(results: queue.Queue, result, error) -> None:
    results.put((result, error))


def test_stream_many_in_flight_errors_in_band(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=partial(_collect, results))
    try:
        for k in range(20):
            client.async_stream_infer("simple", simple_inputs(A + k), request_id=f"ok-{k}")
        client.async_stream_infer("nope", simple_inputs(), request_id="bad-model")
        client.async_stream_infer("simple", simple_inputs(A[:, :15]), request_id="bad-shape")
        client.async_stream_infer("simple", simple_inputs(), request_id="after-errors")
        answers = [results.get(timeout=30) for _ in range(23)]
    finally:
        client.stop_stream()
    errors = {str(e) for r, e in answers if e is not None}
    assert any("Request for unknown model: 'nope' is not found" in e for e in errors)
    assert any("[request id: bad-shape] unexpected shape for input 'INPUT0'" in e for e in errors)
    good = {r.get_response().id: r for r, e in answers if e is None}
    assert set(good) == {*(f"ok-{k}" for k in range(20)), "after-errors"}
    for k in range(20):
        response = good[f"ok-{k}"]
        np.testing.assert_array_equal(response.as_numpy("OUTPUT0"), A + k + B)
        assert response.get_response().parameters["triton_final_response"].bool_param


def test_stream_error_header_closes_with_status(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=partial(_collect, results), headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer("simple", simple_inputs(), request_id="first")
        assert results.get(timeout=30)[1] is None
        client.async_stream_infer("nope", simple_inputs(), request_id="bad")
        result, error = results.get(timeout=30)
        assert result is None and error.status() == "StatusCode.NOT_FOUND"
        assert "Request for unknown model: 'nope' is not found" in error.message()
    finally:
        client.stop_stream()


def test_asyncio_stream_infer(grpc_server: RunningServer) -> None:
    async def run() -> dict[str, np.ndarray]:
        async with aioclient.InferenceServerClient(grpc_server.grpc_url) as client:
            async def requests():
                for k in range(8):
                    yield {"model_name": "simple", "inputs": simple_inputs(A + k), "request_id": str(k)}

            answers = {}
            async for result, error in client.stream_infer(requests()):
                assert error is None
                answers[result.get_response().id] = result.as_numpy("OUTPUT0")
                if len(answers) == 8:
                    break
            return answers

    answers = asyncio.run(run())
    assert sorted(answers) == [str(k) for k in range(8)]
    for k, output in answers.items():
        np.testing.assert_array_equal(output, A + int(k) + B)


# ------------------------------------------------------------------------------------- shared memory




@pytest.fixture
def regions() -> Iterator[tuple[Region, Region]]:
    made = (Region(128), Region(128))
    yield made
    for region in made:
        region.close()


def test_system_shared_memory_inputs_and_outputs(
    client: grpcclient.InferenceServerClient, regions: tuple[Region, Region]
) -> None:
    inp, out = regions
    inp.memory[:128] = A.tobytes() + B.tobytes()
    client.register_system_shared_memory("in", inp.key, 128)
    client.register_system_shared_memory("out", out.key, 128)
    try:
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["in"] == {"name": "in", "key": inp.key, "byte_size": "128"}
        inputs = simple_inputs()
        inputs[0].set_shared_memory("in", 64)
        inputs[1].set_shared_memory("in", 64, offset=64)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out", 64)
        outputs[1].set_shared_memory("out", 64, offset=64)
        result = client.infer("simple", inputs, outputs=outputs)
        assert list(result.get_output("OUTPUT0").shape) == [1, 16]
        written = np.frombuffer(out.memory, dtype=np.int32).reshape(2, 16)
        np.testing.assert_array_equal(written, np.concatenate([A + B, A - B]))
        small = [grpcclient.InferRequestedOutput("OUTPUT0")]
        small[0].set_shared_memory("out", 60)
        with pytest.raises(InferenceServerException, match=r"\(60 bytes\) should be at least 64 bytes"):
            client.infer("simple", simple_inputs(), outputs=small)
        with pytest.raises(InferenceServerException, match="already in manager"):
            client.register_system_shared_memory("in", inp.key, 128)
    finally:
        client.unregister_system_shared_memory()
    assert not client.get_system_shared_memory_status().regions
    inputs = simple_inputs()
    inputs[0].set_shared_memory("in", 64)
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'in'"):
        client.infer("simple", inputs)


def test_cuda_shared_memory_as_on_a_machine_without_gpus(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """Served as Triton serves it where no GPU is: no region, a registration refused, an unknown one unregistered."""
    assert not stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest()).regions
    assert status_of(stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name="x")) == (
        grpc.StatusCode.NOT_FOUND, "Unable to find cuda shared memory region: 'x'")
    assert status_of(stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(name="x", byte_size=8)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "failed to register shared memory region: invalid args")
    stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest(name="x"))


# ---------------------------------------------------------------------------------- settings, control


def test_log_and_trace_settings(client: grpcclient.InferenceServerClient) -> None:
    log = client.get_log_settings(as_json=True)["settings"]
    assert log["log_verbose_level"] == {"uint32_param": 0} and log["log_info"] == {"bool_param": True}
    changed = client.update_log_settings({"log_verbose_level": 1}, as_json=True)["settings"]
    assert changed["log_verbose_level"] == {"uint32_param": 1}
    client.update_log_settings({"log_verbose_level": 0})
    with pytest.raises(InferenceServerException, match="invalid argument for log_format, got: bad"):
        client.update_log_settings({"log_format": "bad"})
    trace = client.get_trace_settings(as_json=True)["settings"]
    assert trace["trace_level"] == {"value": ["OFF"]}
    updated = client.update_trace_settings("simple", {"trace_rate": "7"}, as_json=True)["settings"]
    assert updated["trace_rate"] == {"value": ["7"]}
    assert client.get_trace_settings(as_json=True)["settings"]["trace_rate"] == {"value": ["1000"]}
    with pytest.raises(InferenceServerException, match="Request for unknown model : nope"):
        client.get_trace_settings("nope")


def test_explicit_load_unload_and_shared_memory_off(tmp_path: Path) -> None:
    """A second server in explicit mode, without --allow-system-shared-memory."""
    models.simple(tmp_path / "models")
    with geserve([tmp_path / "models"], tmp_path / "geserve.log", ["--model-control-mode", "explicit"]) as server, \
            grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert not client.is_model_ready("simple")
        client.load_model("simple")
        assert client.is_model_ready("simple")
        np.testing.assert_array_equal(client.infer("simple", simple_inputs()).as_numpy("OUTPUT0"), A + B)
        client.unload_model("simple")
        assert not client.is_model_ready("simple")
        with pytest.raises(InferenceServerException, match="--allow-system-shared-memory") as caught:
            client.register_system_shared_memory("r", "/whatever", 64)
        assert caught.value.status() == "StatusCode.UNIMPLEMENTED"


# ------------------------------------------------------------------------------------- perf_analyzer

_ROW = re.compile(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec")
needs_perf_analyzer = pytest.mark.skipif(not perf_analyzer_path().exists(), reason="perf_analyzer is not installed")


@needs_perf_analyzer
@pytest.mark.parametrize("extra", [[], ["--streaming"]], ids=["unary", "streaming"])
def test_perf_analyzer_grpc_concurrency_1_to_16(grpc_server: RunningServer, extra: list[str]) -> None:
    result = run_perf_analyzer(
        ["-m", "simple", "-i", "grpc", "-u", grpc_server.grpc_url, "--concurrency-range", "1:16",
         "--measurement-interval", "300", "--stability-percentage", "100", *extra],
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    rows = {int(c): float(t) for c, t in _ROW.findall(output)}
    assert sorted(rows) == list(range(1, 17)), output[-3000:]
    assert all(throughput > 0 for throughput in rows.values())
