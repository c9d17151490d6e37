"""geserve on a real NVIDIA GPU: KIND_GPU placement served through the CUDA execution provider with IOBinding, CUDA
shared memory on both protocols, Triton's GPU metrics, and TensorRT's engine cache. Marked `gpu`: every test skips
where onnxruntime has no usable CUDAExecutionProvider or no GPU is visible (scripts/gpu_check.sh runs them)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from geserve.devices.cuda_runtime import device_count
from tests.support import models
from tests.support.server import RunningServer, geserve


def _cuda_ready() -> str | None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install geserve[cuda])"
    if not device_count():
        return "no CUDA device is visible (cuda-python and a driver are needed)"
    return None


_WHY = _cuda_ready()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]



def _on_gpu(model_dir: Path, count: int, extra: str = "") -> None:
    """The model's CPU instance group replaced by `count` instances on GPU 0."""
    config = model_dir / "config.pbtxt"
    text = config.read_text().replace("instance_group [ { kind: KIND_CPU count: 1 } ]", "")
    config.write_text(text + f"instance_group [ {{ count: {count} kind: KIND_GPU gpus: [ 0 ] }} ]\n{extra}")


def _post(server: RunningServer, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
            return response.status, (json.loads(text) if text else {})
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _get(server: RunningServer, url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("gpu_repo")
    _on_gpu(models.simple(repo), 2)
    log = tmp_path_factory.mktemp("gpu_log") / "server.log"
    with geserve([repo], log, ["--allow-system-shared-memory"]) as running:
        yield running


def test_gpu_instances_serve_on_the_listed_gpu(server: RunningServer) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), np.int32)
    body = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": a.ravel().tolist()},
                       {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": b.ravel().tolist()}]}
    status, answer = _post(server, "/v2/models/simple/infer", body)
    assert status == 200, answer
    outputs = {o["name"]: o["data"] for o in answer["outputs"]}
    assert outputs["OUTPUT0"] == (a + b).ravel().tolist() and outputs["OUTPUT1"] == (a - b).ravel().tolist()
    config = json.loads(_get(server, server.base + "/v2/models/simple/config"))
    assert config["instance_group"][0]["kind"] == "KIND_GPU" and config["instance_group"][0]["gpus"] == [0]
    assert "on cuda:0" in server.log()


def test_tritons_gpu_metrics_are_labelled_by_uuid(server: RunningServer) -> None:
    text = _get(server, server.metrics_url).decode()
    for family in ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
                   "nv_gpu_power_usage", "nv_energy_consumption"):
        assert re.search(rf'^{family}{{gpu_uuid="GPU-[0-9a-f-]+"}} ', text, re.M), family


def test_cuda_shared_memory_on_both_protocols(server: RunningServer) -> None:
    import tritonclient.grpc as grpcclient

    from tests.support.cuda_ipc import DeviceBuffer

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, np.int32)
    inputs, outputs = DeviceBuffer(128), DeviceBuffer(128)
    try:
        inputs.write(a)
        inputs.write(b, 64)
        # HTTP registers the inputs, gRPC the outputs: one name space, both protocols.
        status, answer = _post(server, "/v2/cudasharedmemory/region/in/register",
                               {"raw_handle": {"b64": inputs.raw_handle_b64.decode()}, "device_id": 0,
                                "byte_size": 128})
        assert status == 200, answer
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.register_cuda_shared_memory("out", outputs.raw_handle_b64, 0, 128)
        listed = json.loads(_get(server, server.base + "/v2/cudasharedmemory/status"))
        assert sorted((r["name"], r["device_id"], r["byte_size"]) for r in listed) == [("in", 0, 128),
                                                                                       ("out", 0, 128)]
        infer_inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
                        grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        infer_inputs[0].set_shared_memory("in", 64, 0)
        infer_inputs[1].set_shared_memory("in", 64, 64)
        requested = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        requested[0].set_shared_memory("out", 64, 0)
        requested[1].set_shared_memory("out", 64, 64)
        client.infer("simple", infer_inputs, outputs=requested)
        np.testing.assert_array_equal(outputs.read(np.int32, (1, 16)), a + b)
        np.testing.assert_array_equal(outputs.read(np.int32, (1, 16), 64), a - b)
        client.unregister_cuda_shared_memory()
        assert json.loads(_get(server, server.base + "/v2/cudasharedmemory/status")) == []
    finally:
        inputs.free()
        outputs.free()


def _tensorrt_usable() -> bool:
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        return False
    try:  # the provider is listed even when TensorRT's libraries are missing; a session tells
        session = ort.InferenceSession(str(_tiny_model()), providers=["TensorrtExecutionProvider"])
    except Exception:
        return False
    return "TensorrtExecutionProvider" in session.get_providers()


def _tiny_model() -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp())
    return models.simple(folder) / "1" / "model.onnx"


@pytest.mark.skipif(not _WHY and not _tensorrt_usable(), reason="TensorRT's libraries are not installed")
def test_tensorrt_engine_cache_makes_the_second_load_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    _on_gpu(models.simple(repo), 1, 'optimization { execution_accelerators { gpu_execution_accelerator: [ '
                                    '{ name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ] } }')
    cache = tmp_path / "cache"
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(cache))  # the server process inherits it
    timings = []
    for _ in range(2):
        with geserve([repo], tmp_path / "trt.log", ["--model-control-mode", "explicit"]) as running:
            started = time.perf_counter()
            status, answer = _post(running, "/v2/repository/models/simple/load", {})
            timings.append(time.perf_counter() - started)
            assert status == 200, answer
    engines = list((cache / "tensorrt").rglob("*.engine"))
    assert engines, "no TensorRT engine was cached"
    assert timings[1] < timings[0], timings
