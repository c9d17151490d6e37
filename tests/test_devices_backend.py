"""The GE backend's device paths on a machine without accelerators: what a GPU or NPU model is refused with, the
provider options its config asks for, and an offline `.om` model without CANN (UNAVAILABLE, with the reason, on a
real server). Real ONNX Runtime (its CPU build) and real configs; no device is stood in for here."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from geserve.backends.base import ModelSource
from geserve.backends.ge import GeBackend
from geserve.backends.ge.parameters import parse_ge_options
from geserve.backends.ge.providers import configured_accelerator, provider_options
from geserve.compiler import CompileOptions
from geserve.compiler.package import load_key, write_package
from geserve.compiler.pipeline import compile_model
from geserve.config import parse_config_text
from geserve.errors import InvalidArgumentError, UnavailableError
from tests.support import models
from tests.support.server import geserve

_TRT = """
optimization { execution_accelerators { gpu_execution_accelerator: [
  { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" }
                     parameters { key: "max_workspace_size_bytes" value: "1073741824" } } ] } }
"""


def _config(model_dir: Path, extra: str = "") -> object:
    return parse_config_text((model_dir / "config.pbtxt").read_text() + extra, model_dir.name)


def test_a_gpu_instance_without_onnxruntime_gpu_says_what_to_install(tmp_path: Path) -> None:
    model_dir = models.simple(tmp_path)
    config = _config(model_dir, 'instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]')
    with pytest.raises(UnavailableError, match=r"needs CUDAExecutionProvider.*install geserve\[cuda\]"):
        GeBackend().create_instances(config, ModelSource(model_dir, 1))


def test_cuda_and_cann_parameters_are_accepted_in_the_ge_dialects(tmp_path: Path) -> None:
    model_dir = models.simple(tmp_path)
    config = _config(model_dir)
    config.backend = "npu_ge"
    for key, value in {"cudnn_conv_algo_search": "1", "gpu_mem_limit": "1024", "npu_mem_limit": "2048",
                       "enable_cann_graph": "1"}.items():
        config.parameters[key].string_value = value
    options = parse_ge_options(config)
    assert options.device_parameters == {"cudnn_conv_algo_search": "1", "gpu_mem_limit": "1024",
                                         "npu_mem_limit": "2048", "enable_cann_graph": "1"}
    graph = model_dir / "1" / "model.onnx"
    cuda = provider_options(config, options, "cuda", graph, graph)
    assert cuda == {"CUDAExecutionProvider": {"cudnn_conv_algo_search": "HEURISTIC", "gpu_mem_limit": "1024"}}
    npu = provider_options(config, options, "npu", graph, graph)
    assert npu == {"CANNExecutionProvider": {"npu_mem_limit": "2048", "enable_cann_graph": "1"}}
    assert provider_options(config, options, "cpu", graph, graph) == {}


def test_tritons_tensorrt_accelerator_sets_precision_profiles_and_the_engine_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = models.simple(tmp_path, max_batch_size=8)
    config = _config(model_dir, _TRT)
    assert configured_accelerator(config) == "tensorrt"
    graph = model_dir / "1" / "model.onnx"
    trt = provider_options(config, parse_ge_options(config), "tensorrt", graph, graph)["TensorrtExecutionProvider"]
    assert trt["trt_fp16_enable"] == "1" and trt["trt_max_workspace_size"] == "1073741824"
    assert trt["trt_profile_max_shapes"] == "INPUT0:8x16,INPUT1:8x16"
    assert Path(trt["trt_engine_cache_path"]).parent == tmp_path / "cache" / "tensorrt"
    again = provider_options(config, parse_ge_options(config), "tensorrt", graph, graph)["TensorrtExecutionProvider"]
    assert again["trt_engine_cache_path"] == trt["trt_engine_cache_path"]  # the second load finds the first's engine
    config.optimization.execution_accelerators.gpu_execution_accelerator[0].name = "openvino"
    with pytest.raises(InvalidArgumentError, match="unknown gpu_execution_accelerator 'openvino'"):
        configured_accelerator(config)


def test_a_compiled_models_precision_reaches_tensorrt_and_an_encrypted_one_gets_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = models.simple(tmp_path, max_batch_size=8)
    source = model_dir / "1" / "model.onnx"
    manifest, onnx_bytes = compile_model(CompileOptions(model=source, precision_mode="force_fp16", target="cuda"))
    plain = write_package(tmp_path / "plain.gem", manifest, onnx_bytes)
    key_file = tmp_path / "key"
    key_file.write_text("11" * 32)
    sealed = write_package(tmp_path / "sealed.gem", manifest, onnx_bytes, load_key(key_file, env=""))
    config = _config(model_dir, 'optimization { execution_accelerators { gpu_execution_accelerator: '
                                '[ { name: "tensorrt" } ] } }')
    options = parse_ge_options(config)
    trt = provider_options(config, options, "tensorrt", plain, onnx_bytes)["TensorrtExecutionProvider"]
    assert trt["trt_fp16_enable"] == "1" and "trt_engine_cache_path" in trt
    trt = provider_options(config, options, "tensorrt", sealed, onnx_bytes)["TensorrtExecutionProvider"]
    assert "trt_engine_cache_path" not in trt


def _om_repository(repo: Path) -> Path:
    model_dir = repo / "resnet_om"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.om").write_bytes(b"not read without CANN")
    (model_dir / "config.pbtxt").write_text("""
name: "resnet_om"
backend: "npu_ge"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1000 ] } ]
""")
    return model_dir


def test_an_offline_model_without_cann_is_unavailable_naming_pyacl(tmp_path: Path) -> None:
    model_dir = _om_repository(tmp_path)
    config = _config(model_dir)
    with pytest.raises(UnavailableError, match=r"needs pyACL, the 'acl' module of the CANN toolkit"):
        GeBackend().create_instances(config, ModelSource(model_dir, 1))


def test_the_server_reports_the_offline_model_unavailable_with_its_reason(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _om_repository(repo)
    models.simple(repo)
    with geserve([repo], tmp_path / "server.log") as server:
        request = urllib.request.Request(server.base + "/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            index = {entry["name"]: entry for entry in json.loads(response.read())}
    assert index["simple"]["state"] == "READY"
    assert index["resnet_om"]["state"] == "UNAVAILABLE"
    assert "pyACL" in index["resnet_om"]["reason"] and "CANN" in index["resnet_om"]["reason"]
