"""Offline Ascend models (`model.om`, written by ATC) run through pyACL, the GE backend's second engine.

pyACL (`acl`) comes with the CANN toolkit, never from PyPI: it is imported when an `.om` model loads, and without
it the model is UNAVAILABLE with a reason naming what is missing. Written against pyACL's documented API (acl.mdl /
acl.rt); no NPU was at hand, so tests drive it with a stand-in `acl` module (tests/test_devices_offline.py).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from geserve.backends.base import Execution, ModelInstance, Results
from geserve.backends.ge.parameters import GeOptions
from geserve.config import ModelConfig
from geserve.devices.placement import placements
from geserve.errors import GeserveError, InternalError, InvalidArgumentError, UnavailableError
from geserve.types import ComputeTimes, InferenceRequest, InferenceResponse, OutputTensor
from geserve.types.datatypes import BY_WIRE

OM_FILENAME = "model.om"
_MEMCPY_HOST_TO_DEVICE, _MEMCPY_DEVICE_TO_HOST = 1, 2
_MALLOC_HUGE_FIRST = 0
_BATCH_INPUT = "ascend_mbatch_shape_data"  # the input ATC adds to a model with --dynamic_batch_size
# aclDataType -> wire datatype.
_ACL_TYPES = {0: "FP32", 1: "FP16", 2: "INT8", 3: "INT32", 4: "UINT8", 6: "INT16", 7: "UINT16", 8: "UINT32",
              9: "INT64", 10: "UINT64", 11: "FP64", 12: "BOOL", 27: "BF16"}
_init_lock = threading.Lock()
_initialized = False


def is_offline_model(path: Path) -> bool:
    return path.suffix == ".om"


def find_offline_model(version_dir: Path, configured: str) -> Path | None:
    """The configured `.om` file, or `model.om` when the config names no file and there is no `model.onnx`."""
    if configured.endswith(".om"):
        return version_dir / configured
    if configured in ("", "model.onnx") and not (version_dir / "model.onnx").exists():
        candidate = version_dir / OM_FILENAME
        return candidate if candidate.is_file() else None
    return None


def load_acl(model: str) -> ModuleType:
    """pyACL, initialised once per process; UnavailableError saying what is missing otherwise."""
    global _initialized
    try:
        import acl
    except ImportError as exc:
        raise UnavailableError(
            f"model '{model}' is an offline Ascend model (.om) and needs pyACL, the 'acl' module of the CANN toolkit "
            f"(install CANN, then `source /usr/local/Ascend/ascend-toolkit/set_env.sh`): {exc}"
        ) from None
    with _init_lock:
        if not _initialized:
            _check(acl.init(), "acl.init")
            _initialized = True
    return acl


def _check(ret: Any, what: str) -> None:
    if ret != 0:
        raise UnavailableError(f"{what} failed with ACL error {ret}")


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    wire_type: str
    dims: tuple[int, ...]  # as the model describes it, batch included (its largest gear for a dynamic batch)
    size: int  # bytes at the largest batch


@dataclass(frozen=True, slots=True)
class _Description:
    inputs: list[_Tensor]
    outputs: list[_Tensor]
    gears: list[int]  # [] for a fixed batch
    batch_input: int  # index of ascend_mbatch_shape_data, -1 without


class _LoadedModel:
    """One `.om` loaded on one device, with a context of its own."""

    def __init__(self, acl: ModuleType, path: Path, device_id: int) -> None:
        self._acl = acl
        self.device_id = device_id
        _check(acl.rt.set_device(device_id), f"acl.rt.set_device({device_id})")
        self.context, ret = acl.rt.create_context(device_id)
        _check(ret, "acl.rt.create_context")
        self.model_id, ret = acl.mdl.load_from_file(str(path))
        _check(ret, f"acl.mdl.load_from_file({path})")
        self.desc = acl.mdl.create_desc()
        _check(acl.mdl.get_desc(self.desc, self.model_id), "acl.mdl.get_desc")
        self.description = self._describe()

    def _describe(self) -> _Description:
        acl, desc = self._acl, self.desc

        def tensor(kind: str, index: int) -> _Tensor:
            dims, ret = getattr(acl.mdl, f"get_{kind}_dims")(desc, index)
            _check(ret, f"acl.mdl.get_{kind}_dims")
            code = getattr(acl.mdl, f"get_{kind}_data_type")(desc, index)
            if code not in _ACL_TYPES:
                raise UnavailableError(f"the {kind} '{dims['name']}' has ACL data type {code}, not served by geserve")
            size = getattr(acl.mdl, f"get_{kind}_size_by_index")(desc, index)
            name = getattr(acl.mdl, f"get_{kind}_name_by_index")(desc, index) or dims["name"]
            return _Tensor(name, _ACL_TYPES[code], tuple(int(d) for d in dims["dims"]), int(size))

        inputs = [tensor("input", i) for i in range(acl.mdl.get_num_inputs(desc))]
        outputs = [tensor("output", i) for i in range(acl.mdl.get_num_outputs(desc))]
        batch_input = next((i for i, t in enumerate(inputs) if t.name == _BATCH_INPUT), -1)
        gears: list[int] = []
        if batch_input >= 0:
            info, ret = acl.mdl.get_dynamic_batch(desc)
            _check(ret, "acl.mdl.get_dynamic_batch")
            gears = sorted(int(b) for b in info["batch"][: info["batchCount"]])
        return _Description(inputs, outputs, gears, batch_input)

    def unload(self) -> None:
        acl = self._acl
        acl.mdl.unload(self.model_id)
        acl.mdl.destroy_desc(self.desc)
        acl.rt.destroy_context(self.context)


def _configure_dump(acl: ModuleType, config: ModelConfig, options: GeOptions) -> None:
    """dump_data and profiling through pyACL's JSON configuration (acl.mdl.set_dump), under the dump folder."""
    if not (options.dump_data or options.profiling):
        return
    folder = Path(tempfile.gettempdir()) / "geserve_dump" / config.name
    folder.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {}
    if options.dump_data:
        settings["dump"] = {"dump_path": str(folder), "dump_mode": "all", "dump_list": [{"model_name": config.name}]}
    if options.profiling:
        settings["profiler"] = {"switch": "on", "output": str(folder / "profiling")}
    path = folder / "acl.json"
    path.write_text(json.dumps(settings))
    _check(acl.mdl.set_dump(str(path)), "acl.mdl.set_dump")


def auto_complete_om(config: ModelConfig, path: Path, default_max_batch_size: int) -> None:
    """Inputs, outputs and max_batch_size from the model's own description, for what the config leaves out."""
    acl = load_acl(config.name)
    loaded = _LoadedModel(acl, path, 0)
    try:
        described = loaded.description
    finally:
        loaded.unload()
    batching = bool(described.gears)
    if config.max_batch_size == 0 and batching:
        config.max_batch_size = min(max(described.gears), default_max_batch_size) or max(described.gears)
    for kind, tensors in (("input", described.inputs), ("output", described.outputs)):
        listed = getattr(config, kind)
        if len(listed):
            continue
        for tensor in tensors:
            if tensor.name == _BATCH_INPUT:
                continue
            entry = listed.add()
            entry.name = tensor.name
            entry.data_type = BY_WIRE[tensor.wire_type].config
            entry.dims.extend(tensor.dims[1:] if batching else tensor.dims)


def create_om_instances(config: ModelConfig, path: Path, options: GeOptions) -> list[ModelInstance]:
    if not path.is_file():
        raise InvalidArgumentError(f"model file {path} not found for model '{config.name}'")
    acl = load_acl(config.name)
    _configure_dump(acl, config, options)
    if options.accelerator not in ("npu", "cann", None):
        raise InvalidArgumentError(f"model '{config.name}': an .om model runs on Ascend NPUs only, not on "
                                   f"'{options.accelerator}'")
    return [
        OmInstance(p.name, _LoadedModel(acl, path, p.device_id), config)
        for p in placements(config.instance_group, options.device_ids, options.instance_exec_blocks,
                            options.device_exec_blocks, model=config.name)
    ]


class OmInstance(ModelInstance):
    """Executes a batch on the NPU: inputs joined and padded to a gear, copied into device buffers, outputs back."""

    def __init__(self, name: str, model: _LoadedModel, config: ModelConfig) -> None:
        self.name = name
        self.device = f"npu:{model.device_id}"
        self._model = model
        self._acl = model._acl
        described = model.description
        self._gears = described.gears
        self._batching = config.max_batch_size > 0
        self._inputs = [t for t in described.inputs if t.name != _BATCH_INPUT]
        self._outputs = described.outputs
        self._in_buffers = [self._device_buffer(t.size) for t in described.inputs]
        self._out_buffers = [self._device_buffer(t.size) for t in described.outputs]
        self._in_set = self._dataset(self._in_buffers)
        self._out_set = self._dataset(self._out_buffers)
        self._index = {t.name: i for i, t in enumerate(described.inputs)}

    def _device_buffer(self, size: int) -> tuple[int, int]:
        pointer, ret = self._acl.rt.malloc(max(size, 1), _MALLOC_HUGE_FIRST)
        _check(ret, "acl.rt.malloc")
        return pointer, size

    def _dataset(self, buffers: list[tuple[int, int]]) -> Any:
        acl = self._acl
        dataset = acl.mdl.create_dataset()
        for pointer, size in buffers:
            _, ret = acl.mdl.add_dataset_buffer(dataset, acl.create_data_buffer(pointer, size))
            _check(ret, "acl.mdl.add_dataset_buffer")
        return dataset

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        start = time.monotonic_ns()
        try:
            return self._execute(requests, start)
        except GeserveError as exc:
            return Execution.timed([exc] * len(requests), start)
        except Exception as exc:
            return Execution.timed([InternalError(f"ACL execution failed on {self.name}: {exc}")] * len(requests),
                                   start)

    def _execute(self, requests: list[InferenceRequest], start: int) -> Execution:
        acl = self._acl
        _check(acl.rt.set_context(self._model.context), "acl.rt.set_context")
        sizes = [r.batch_size for r in requests] if self._batching else [0] * len(requests)
        total = sum(sizes)
        gear = self._gear_for(total)
        for tensor in self._inputs:
            self._feed(tensor, requests, total, gear)
        if gear:
            batch_index = self._model.description.batch_input
            _check(acl.mdl.set_dynamic_batch_size(self._model.model_id, self._in_set, batch_index, gear),
                   "acl.mdl.set_dynamic_batch_size")
        fed = time.monotonic_ns()
        _check(acl.mdl.execute(self._model.model_id, self._in_set, self._out_set), "acl.mdl.execute")
        ran = time.monotonic_ns()
        responses = self._responses(requests, sizes, self._fetch_outputs(gear))
        return Execution(responses, ComputeTimes(fed - start, ran - fed, time.monotonic_ns() - ran))

    def _gear_for(self, total: int) -> int:
        """The smallest gear that holds a batch of `total`; 0 for a model without gears."""
        gear = next((g for g in self._gears if g >= total), 0) if self._gears else 0
        if self._gears and gear == 0:
            raise InvalidArgumentError(f"batch of {total} is larger than the model's largest gear {self._gears[-1]}")
        return gear

    def _feed(self, tensor: _Tensor, requests: list[InferenceRequest], total: int, gear: int) -> None:
        """Copy the requests' values of input `tensor`, joined and padded up to `gear`, into its device buffer."""
        parts = [next(t.data for t in r.inputs if t.name == tensor.name) for r in requests]
        array = np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0])
        if gear > total:  # pad the batch up to the gear, as the dynamic batcher's gears do
            array = np.concatenate([array, np.zeros((gear - total, *array.shape[1:]), array.dtype)])
        pointer, capacity = self._in_buffers[self._index[tensor.name]]
        if array.nbytes > capacity:
            raise InvalidArgumentError(f"input '{tensor.name}' holds {array.nbytes} bytes; the model takes "
                                       f"at most {capacity}")
        _check(self._acl.rt.memcpy(pointer, capacity, array.ctypes.data, array.nbytes, _MEMCPY_HOST_TO_DEVICE),
               "acl.rt.memcpy")

    def _fetch_outputs(self, gear: int) -> dict[str, np.ndarray]:
        """Every output, copied back from its device buffer (a batching model's hold the whole gear)."""
        results: dict[str, np.ndarray] = {}
        for tensor, (pointer, capacity) in zip(self._outputs, self._out_buffers, strict=True):
            dtype = BY_WIRE[tensor.wire_type].numpy
            dims = ((gear or tensor.dims[0]), *tensor.dims[1:]) if self._batching else tensor.dims
            host = np.empty(dims, dtype)
            _check(self._acl.rt.memcpy(host.ctypes.data, host.nbytes, pointer, min(host.nbytes, capacity),
                                       _MEMCPY_DEVICE_TO_HOST), "acl.rt.memcpy")
            results[tensor.name] = host
        return results

    def _responses(self, requests: list[InferenceRequest], sizes: list[int],
                   results: dict[str, np.ndarray]) -> Results:
        """Each request's response: the outputs it asked for (all when it named none), its rows of a batch."""
        responses: Results = []
        offset = 0
        for request, size in zip(requests, sizes, strict=True):
            wanted = [o.name for o in request.outputs] if request.outputs is not None else list(results)
            outputs = []
            for name in wanted:
                value = results[name][offset : offset + size] if self._batching else results[name]
                outputs.append(OutputTensor(name, _wire(self._outputs, name), value.shape, value))
            responses.append(InferenceResponse(request.model_name, request.model_version, outputs, request.id))
            offset += size
        return responses

    def finalize(self) -> None:
        acl = self._acl
        for dataset in (self._in_set, self._out_set):
            for index in range(acl.mdl.get_dataset_num_buffers(dataset)):
                acl.destroy_data_buffer(acl.mdl.get_dataset_buffer(dataset, index))
            acl.mdl.destroy_dataset(dataset)
        for pointer, _ in (*self._in_buffers, *self._out_buffers):
            acl.rt.free(pointer)
        self._model.unload()


def _wire(tensors: list[_Tensor], name: str) -> str:
    return next(t.wire_type for t in tensors if t.name == name)
