"""geserve.devices without a device: placement, execution targets, and the options each execution provider gets from
a model's configuration (CUDA, TensorRT, CANN). Pure functions; nothing here needs an accelerator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from geserve.devices import KIND_CPU, KIND_GPU, placements, resolve_target
from geserve.devices.cann import cann_options, gears_from_ge
from geserve.devices.cuda import cuda_options
from geserve.devices.target import accelerator_of
from geserve.devices.tensorrt import (
    engine_cache_path,
    engine_options,
    precision_of,
    profile_shapes,
    tensorrt_options,
)
from geserve.errors import InvalidArgumentError, UnavailableError


def _group(name: str, kind: int, count: int = 1, gpus: tuple[int, ...] = ()) -> model_config_pb2.ModelInstanceGroup:
    return model_config_pb2.ModelInstanceGroup(name=name, kind=kind, count=count, gpus=list(gpus))


def test_gpu_groups_put_count_instances_on_each_listed_gpu() -> None:
    placed = placements([_group("g", KIND_GPU, 2, (0, 2)), _group("c", KIND_CPU, 1)], visible_gpus=(0, 1, 2))
    assert [(p.name, p.kind, p.device_id) for p in placed] == [
        ("g_0", KIND_GPU, 0), ("g_1", KIND_GPU, 0), ("g_2", KIND_GPU, 2), ("g_3", KIND_GPU, 2), ("c_4", KIND_CPU, 0)
    ]


def test_a_gpu_group_without_gpus_spreads_over_visible_gpus_or_the_ge_device_ids() -> None:
    assert [p.device_id for p in placements([_group("g", KIND_GPU)], visible_gpus=(0, 1))] == [0, 1]
    assert [p.device_id for p in placements([_group("g", KIND_GPU)], device_ids=[3, 5])] == [3, 5]
    assert [p.device_id for p in placements([_group("g", KIND_GPU)])] == [0]  # nothing known: device 0


def test_exec_blocks_size_each_device() -> None:
    assert len(placements([_group("g", KIND_GPU, 2, (0, 1))], instance_exec_blocks=3)) == 12
    assert len(placements([_group("g", KIND_GPU, 2, (0, 1))], device_exec_blocks=1)) == 2


def test_an_invisible_gpu_is_refused_in_tritons_words() -> None:
    words = ("instance group g of model m specifies invalid or unsupported gpu id 4. GPUs with at least the minimum "
             "required CUDA compute compatibility of 6.0 are: 0 1")
    with pytest.raises(InvalidArgumentError, match=re.escape(words)):
        placements([_group("g", KIND_GPU, 1, (4,))], visible_gpus=(0, 1), model="m")


def test_cpu_targets_stay_plain_and_accelerators_need_their_providers() -> None:
    assert resolve_target(KIND_CPU, 0).providers == [("CPUExecutionProvider", {})]
    assert accelerator_of(KIND_CPU, None) == "cpu" and accelerator_of(KIND_GPU, "gpu") == "cuda"
    needs = r"needs TensorrtExecutionProvider, CUDAExecutionProvider.*geserve\[cuda\]"
    with pytest.raises(UnavailableError, match=needs):
        resolve_target(KIND_GPU, 0, "tensorrt")
    with pytest.raises(UnavailableError, match="onnxruntime-cann"):
        resolve_target(KIND_GPU, 0, "npu")
    with pytest.raises(UnavailableError, match="unknown execution accelerator 'tpu'"):
        resolve_target(KIND_GPU, 0, "tpu")


def test_provider_order_and_options_when_the_providers_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime-gpu is not installed here: the provider list is stood in for."""
    monkeypatch.setattr("geserve.devices.target.available_providers", lambda: [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    target = resolve_target(KIND_GPU, 1, "tensorrt", {"CUDAExecutionProvider": {"gpu_mem_limit": "8"}})
    assert target.device == "cuda:1" and target.on_gpu and target.device_id == 1
    assert target.providers == [
        ("TensorrtExecutionProvider", {"device_id": 1}),
        ("CUDAExecutionProvider", {"device_id": 1, "gpu_mem_limit": "8"}),
        ("CPUExecutionProvider", {}),
    ]


def test_cuda_options_take_tritons_parameter_names() -> None:
    options = cuda_options({"cudnn_conv_algo_search": "1", "gpu_mem_limit": "4294967296", "arena_extend_strategy": "1",
                            "do_copy_in_default_stream": "true", "intra_op_thread_count": "2"}, cuda_graphs=True)
    assert options == {"cudnn_conv_algo_search": "HEURISTIC", "gpu_mem_limit": "4294967296",
                       "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": "1",
                       "enable_cuda_graph": "1"}
    with pytest.raises(InvalidArgumentError, match="cudnn_conv_algo_search"):
        cuda_options({"cudnn_conv_algo_search": "7"})
    with pytest.raises(InvalidArgumentError, match="gpu_mem_limit"):
        cuda_options({"gpu_mem_limit": "lots"})


def test_tensorrt_precision_follows_the_models_settings() -> None:
    assert precision_of("FP16") == "fp16" and precision_of("", "force_fp32") == "fp32"
    assert precision_of("", "allow_mix_precision") == "fp16" and precision_of("", "force_fp32", "int8") == "int8"
    with pytest.raises(InvalidArgumentError, match="FP32, FP16, INT8"):
        precision_of("FP8")


def test_tensorrt_profiles_cover_the_batch_range_when_only_the_batch_is_dynamic() -> None:
    assert profile_shapes([("x", (-1, 3, 224, 224))], 64) == {
        "trt_profile_min_shapes": "x:1x3x224x224", "trt_profile_opt_shapes": "x:64x3x224x224",
        "trt_profile_max_shapes": "x:64x3x224x224"}
    assert profile_shapes([("x", (-1, 3, -1, -1))], 8) == {}
    assert profile_shapes([("x", (1, 3))], 8) == {}


def test_tensorrt_engine_cache_is_keyed_by_graph_and_settings(tmp_path: Path) -> None:
    profiles = profile_shapes([("x", (-1, 4))], 8)
    options = tensorrt_options("abc", "fp16", profiles, engine_options({"max_workspace_size_bytes": "1024"}),
                               root=tmp_path)
    assert options["trt_fp16_enable"] == "1" and options["trt_int8_enable"] == "0"
    assert options["trt_max_workspace_size"] == "1024" and options["trt_engine_cache_enable"] == "1"
    path = Path(options["trt_engine_cache_path"])
    assert path.is_dir() and path.parent == tmp_path / "tensorrt"
    assert path == engine_cache_path("abc", "fp16", profiles, {"trt_max_workspace_size": "1024"}, tmp_path)
    assert engine_cache_path("abd", "fp16", profiles, {}, tmp_path) != engine_cache_path("abc", "fp16", profiles, {},
                                                                                         tmp_path)
    assert engine_cache_path("abc", "fp32", profiles, {}, tmp_path) != engine_cache_path("abc", "fp16", profiles, {},
                                                                                         tmp_path)
    uncached = tensorrt_options("abc", "int8", {}, {}, cache=False, root=tmp_path)
    assert "trt_engine_cache_path" not in uncached and uncached["trt_int8_enable"] == "1"
    with pytest.raises(InvalidArgumentError, match="unknown TensorRT accelerator parameter 'speed'"):
        engine_options({"speed": "max"})


def test_cann_options_from_the_ge_dialects() -> None:
    ge = {"session.ge.exec.precision_mode_v2": "mixed_float16", "session.ge.graphMemoryMaxSize": "1073741824",
          "session.ge.op_select_implmode": "high_performance"}
    assert cann_options(ge, {"enable_cann_graph": "false"}, dump_graph=True) == {
        "precision_mode": "allow_mix_precision_fp16", "npu_mem_limit": "1073741824", "enable_cann_graph": "0",
        "op_select_impl_mode": "high_performance", "dump_graphs": "1", "dump_om_model": "1"}
    assert cann_options({"session.ge.exec.precision_mode": "force_fp16"}, {}) == {"precision_mode": "force_fp16"}
    with pytest.raises(InvalidArgumentError, match="not both"):
        cann_options({"session.ge.exec.precision_mode": "force_fp16",
                      "session.ge.exec.precision_mode_v2": "fp16"}, {})
    with pytest.raises(InvalidArgumentError, match="precision_mode_v2"):
        cann_options({"session.ge.exec.precision_mode_v2": "fp8"}, {})


def test_batch_gears_from_ge_dynamic_dims() -> None:
    assert gears_from_ge({"graph.ge.inputShape": "x:-1,3,224,224;m:-1,8", "graph.ge.dynamicDims": "8,8;1,1;4,4"}) \
        == [1, 4, 8]
    assert gears_from_ge({}) == []
    with pytest.raises(InvalidArgumentError, match="batch gears"):
        gears_from_ge({"graph.ge.inputShape": "x:1,-1", "graph.ge.dynamicDims": "4;8"})
    with pytest.raises(InvalidArgumentError, match="2 dynamic dim"):
        gears_from_ge({"graph.ge.inputShape": "x:-1,3;y:-1,2", "graph.ge.dynamicDims": "4"})
