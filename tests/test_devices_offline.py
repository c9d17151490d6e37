"""The offline `.om` engine's flow (describe, auto-complete, buffers, gears, execute, finalize) against a stand-in for
pyACL: CANN cannot be installed here, so `acl` is a small fake whose "model" doubles its one input. The fake keeps
pyACL's documented call shapes (return codes, (value, ret) pairs, device pointers as integers)."""

from __future__ import annotations

import ctypes
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from geserve.backends.base import ModelSource
from geserve.backends.ge import GeBackend, offline
from geserve.config import ModelConfig, fill_defaults
from geserve.devices import KIND_CPU
from geserve.types import InferenceRequest, InputTensor


def _fake_acl(gears: list[int], row: int = 4) -> types.ModuleType:
    """One model: input "x" FP32 [gear, row] (+ ascend_mbatch_shape_data), output "y" = 2 * x."""
    memory: dict[int, ctypes.Array] = {}
    state: dict[str, int] = {"batch": max(gears)}
    inputs = [("x", [max(gears), row], 0, max(gears) * row * 4), ("ascend_mbatch_shape_data", [1], 9, 8)]
    outputs = [("y", [max(gears), row], 0, max(gears) * row * 4)]

    def malloc(size: int, policy: int) -> tuple[int, int]:
        buffer = ctypes.create_string_buffer(size)
        memory[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer), 0

    def memcpy(dst: int, dst_size: int, src: int, count: int, kind: int) -> int:
        ctypes.memmove(dst, src, count)
        return 0

    datasets: dict[int, list[tuple[int, int]]] = {}

    def create_dataset() -> int:
        datasets[len(datasets) + 1] = []
        return len(datasets)

    def add_dataset_buffer(dataset: int, buffer: tuple[int, int]) -> tuple[int, int]:
        datasets[dataset].append(buffer)
        return dataset, 0

    def execute(model_id: int, inp: int, out: int) -> int:
        (x_ptr, _), (y_ptr, _) = datasets[inp][0], datasets[out][0]
        count = state["batch"] * row
        x = np.frombuffer((ctypes.c_float * count).from_address(x_ptr), np.float32)
        np.frombuffer((ctypes.c_float * count).from_address(y_ptr), np.float32)[:] = 2 * x
        return 0

    def set_dynamic_batch_size(model_id: int, dataset: int, index: int, batch: int) -> int:
        assert index == 1 and batch in gears
        state["batch"] = batch
        return 0

    def tensors(kind: str) -> list:
        return inputs if kind == "input" else outputs

    mdl = types.SimpleNamespace(
        load_from_file=lambda path: (7, 0), create_desc=lambda: "desc", get_desc=lambda desc, model: 0,
        get_num_inputs=lambda desc: len(inputs), get_num_outputs=lambda desc: len(outputs),
        create_dataset=create_dataset, add_dataset_buffer=add_dataset_buffer, execute=execute,
        set_dynamic_batch_size=set_dynamic_batch_size, get_dynamic_batch=lambda desc: (
            {"batchCount": len(gears), "batch": gears}, 0),
        get_dataset_num_buffers=lambda dataset: len(datasets[dataset]),
        get_dataset_buffer=lambda dataset, index: datasets[dataset][index],
        destroy_dataset=lambda dataset: 0, unload=lambda model: 0, destroy_desc=lambda desc: 0, set_dump=lambda p: 0,
    )
    for kind in ("input", "output"):
        setattr(mdl, f"get_{kind}_dims", lambda desc, i, k=kind: (
            {"name": tensors(k)[i][0], "dimCount": len(tensors(k)[i][1]), "dims": tensors(k)[i][1]}, 0))
        setattr(mdl, f"get_{kind}_data_type", lambda desc, i, k=kind: tensors(k)[i][2])
        setattr(mdl, f"get_{kind}_size_by_index", lambda desc, i, k=kind: tensors(k)[i][3])
        setattr(mdl, f"get_{kind}_name_by_index", lambda desc, i, k=kind: tensors(k)[i][0])
    rt = types.SimpleNamespace(
        set_device=lambda device: 0, create_context=lambda device: ("ctx", 0), set_context=lambda ctx: 0,
        destroy_context=lambda ctx: 0, malloc=malloc, memcpy=memcpy, free=lambda ptr: memory.pop(ptr) and 0,
    )
    acl = types.ModuleType("acl")
    acl.init = lambda *args: 0  # type: ignore[attr-defined]
    acl.mdl, acl.rt = mdl, rt  # type: ignore[attr-defined]
    acl.create_data_buffer = lambda ptr, size: (ptr, size)  # type: ignore[attr-defined]
    acl.destroy_data_buffer = lambda buffer: 0  # type: ignore[attr-defined]
    acl.memory = memory  # type: ignore[attr-defined]
    return acl


@pytest.fixture
def acl(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fake = _fake_acl([1, 2, 4, 8])
    monkeypatch.setitem(sys.modules, "acl", fake)
    monkeypatch.setattr(offline, "_initialized", False)
    return fake


def _om_model(tmp_path: Path) -> Path:
    (tmp_path / "om" / "1").mkdir(parents=True)
    (tmp_path / "om" / "1" / "model.om").write_bytes(b"om")
    return tmp_path / "om"


def test_auto_complete_and_execute_with_gears(tmp_path: Path, acl: types.ModuleType) -> None:
    model_dir = _om_model(tmp_path)
    config = ModelConfig(name="om", backend="npu_ge")
    backend = GeBackend()
    backend.auto_complete_config(config, ModelSource(model_dir, 1))
    fill_defaults(config, KIND_CPU, backend.default_model_filename)
    assert config.max_batch_size == 4  # the largest gear, capped by the default max batch size
    assert [(t.name, list(t.dims)) for t in config.input] == [("x", [4])]
    assert [(t.name, list(t.dims)) for t in config.output] == [("y", [4])]
    instances = backend.create_instances(config, ModelSource(model_dir, 1))
    assert [i.device for i in instances] == ["npu:0"]  # type: ignore[attr-defined]
    first = np.arange(8, dtype=np.float32).reshape(2, 4)
    second = np.ones((1, 4), np.float32)
    requests = [InferenceRequest("om", "1", [InputTensor("x", "FP32", data.shape, data)], batch_size=len(data))
                for data in (first, second)]
    execution = instances[0].execute(requests)  # 3 rows run on the gear of 4, padded
    results = [r.outputs[0].data for r in execution.results]  # type: ignore[union-attr]
    np.testing.assert_array_equal(results[0], 2 * first)
    np.testing.assert_array_equal(results[1], 2 * second)
    instances[0].finalize()
    assert not acl.memory  # every device buffer freed


def test_a_batch_past_the_largest_gear_is_refused(tmp_path: Path, acl: types.ModuleType) -> None:
    model_dir = _om_model(tmp_path)
    config = ModelConfig(name="om", backend="npu_ge", max_batch_size=8)
    backend = GeBackend()
    backend.auto_complete_config(config, ModelSource(model_dir, 1))
    fill_defaults(config, KIND_CPU, backend.default_model_filename)
    instance = backend.create_instances(config, ModelSource(model_dir, 1))[0]
    data = np.zeros((9, 4), np.float32)
    execution = instance.execute([InferenceRequest("om", "1", [InputTensor("x", "FP32", data.shape, data)],
                                                   batch_size=9)])
    assert "larger than the model's largest gear 8" in str(execution.results[0])
