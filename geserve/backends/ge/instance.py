"""One GE instance: an ONNX Runtime session that executes a batch of requests and slices the outputs back."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import ml_dtypes
import numpy as np
import onnxruntime as ort

from geserve.backends.base import Execution, ModelInstance, Results
from geserve.errors import GeserveError, InternalError, InvalidArgumentError, UnavailableError
from geserve.types import ComputeTimes, InferenceRequest, InferenceResponse, OutputTensor


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """How a config tensor maps onto the graph: its wire datatype and the graph-side shape (reshape)."""

    name: str
    wire_type: str
    config_dims: tuple[int, ...]
    graph_dims: tuple[int, ...] | None  # None: same as the config dims


@dataclass(frozen=True, slots=True)
class ModelLayout:
    batching: bool
    inputs: dict[str, TensorLayout]
    outputs: dict[str, TensorLayout]
    output_names: tuple[str, ...]


class GeInstance(ModelInstance):
    def __init__(self, name: str, session: ort.InferenceSession, layout: ModelLayout, device: str) -> None:
        self.name = name
        self.device = device
        # On the CPU a run is compute on the calling thread (what the pool's CPU-time measure sees): measured short
        # for small models, it may run on the loop. On a GPU or an NPU the thread waits for the device (copies, a
        # queue shared with other instances), which CPU time does not show: those stay on their worker thread.
        self.inline_allowed = device == "cpu"
        self._session = session
        self._layout = layout
        self._string_inputs = {n for n, t in layout.inputs.items() if t.wire_type == "BYTES"}
        uses_bf16 = any(t.wire_type == "BF16" for t in (*layout.inputs.values(), *layout.outputs.values()))
        self._run = self._run_bound if uses_bf16 else _direct_run(session)
        uses_strings = any(t.wire_type == "BYTES" for t in (*layout.inputs.values(), *layout.outputs.values()))
        if device.startswith("cuda:") and not (uses_bf16 or uses_strings):  # strings and bf16 bind on the host
            self._device_id = int(device.partition(":")[2])
            self._run = self._run_on_gpu

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        start = time.monotonic_ns()
        try:
            if len(requests) == 1:
                return self._run_one(requests[0], start)
            return self._run_batch(requests, start)
        except GeserveError as exc:
            return Execution.timed([exc] * len(requests), start)
        except Exception as exc:  # ONNX Runtime raises its own types; report them, never crash the server
            error = InternalError(f"onnxruntime execution failed on {self.name}: {exc}")
            return Execution.timed([error] * len(requests), start)

    def finalize(self) -> None:
        # `_run` holds the native session too: both go, or the session's weights and arena outlive the unload for as
        # long as anything (a reference cycle, a remembered request header) keeps this instance.
        self._session = None
        self._run = _unloaded

    def _feed(self, name: str, array: np.ndarray, batch: int) -> np.ndarray:
        layout = self._layout.inputs[name]
        if layout.graph_dims is not None:
            array = array.reshape(((batch,) if self._layout.batching else ()) + layout.graph_dims)
        if name in self._string_inputs:
            array = _decode_strings(name, array)
        return array

    def _run_one(self, request: InferenceRequest, start: int) -> Execution:
        batch = request.batch_size
        feed = {t.name: self._feed(t.name, t.data, batch) for t in request.inputs}
        names = _requested_names(request, self._layout.output_names)
        fed = time.monotonic_ns()
        results = self._run(names, feed)
        ran = time.monotonic_ns()
        outputs = [self._output(name, value, batch) for name, value in zip(names, results, strict=True)]
        response = InferenceResponse(request.model_name, request.model_version, outputs, request.id)
        return Execution([response], ComputeTimes(fed - start, ran - fed, time.monotonic_ns() - ran))

    def _run_batch(self, requests: list[InferenceRequest], start: int) -> Execution:
        """Several requests in one session run: inputs joined along the batch axis, outputs split back."""
        sizes = [r.batch_size for r in requests]
        total = sum(sizes)
        feed = {name: self._feed(name, np.concatenate(parts), total) for name, parts in _joined(requests).items()}
        names = list(self._layout.output_names)
        fed = time.monotonic_ns()
        results = dict(zip(names, self._run(names, feed), strict=True))
        ran = time.monotonic_ns()
        responses: Results = []
        end = 0
        for request, size in zip(requests, sizes, strict=True):  # Python ints: np.cumsum costs more for a few rows
            begin, end = end, end + size
            wanted = _requested_names(request, self._layout.output_names)
            outputs = [self._output(n, results[n][begin:end], size) for n in wanted]
            responses.append(InferenceResponse(request.model_name, request.model_version, outputs, request.id))
        return Execution(responses, ComputeTimes(fed - start, ran - fed, time.monotonic_ns() - ran))

    def _run_bound(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """ONNX Runtime's numpy bridge has no bfloat16; bind such tensors as OrtValues and read them raw."""
        binding = self._session.io_binding()
        for name, array in feed.items():
            if array.dtype == ml_dtypes.bfloat16:
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), _ONNX_BFLOAT16)
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in names:
            binding.bind_output(name, "cpu")
        self._session.run_with_iobinding(binding)
        return [_ortvalue_to_numpy(value) for value in binding.get_outputs()]

    def _run_on_gpu(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """On a GPU (IOBinding): each input bound once and copied to the device in the run; outputs bound on the
        device, so ONNX Runtime allocates them there, and copied back in one step after the run."""
        binding = self._session.io_binding()
        for name, array in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in names:
            binding.bind_output(name, "cuda", self._device_id)
        self._session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()

    def _output(self, name: str, value: np.ndarray, batch: int) -> OutputTensor:
        layout = self._layout.outputs[name]
        if layout.graph_dims is not None:
            value = value.reshape(((batch,) if self._layout.batching else ()) + layout.config_dims)
        return OutputTensor(name, layout.wire_type, value.shape, value)


_ONNX_BFLOAT16 = 16


def _unloaded(names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    raise UnavailableError("the model instance was unloaded")


def _direct_run(session: ort.InferenceSession) -> Callable[[list[str], dict[str, np.ndarray]], list[np.ndarray]]:
    """The session's native run. `InferenceSession.run` wraps it with checks the service has already made (the
    inputs are the model's, validated before queueing), and with a retry on another provider that only applies to an
    accelerator session: ~3 µs a run on the CPU, measured on the MLP. Falls back to `run` where the native object is
    not exposed or the session is not CPU-only."""
    native = getattr(session, "_sess", None)
    if native is None or session.get_providers() != ["CPUExecutionProvider"]:
        return session.run
    return lambda names, feed: native.run(names, feed, None)


def _ortvalue_to_numpy(value: ort.OrtValue) -> np.ndarray:
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    shape = value.shape()
    count = int(np.prod(shape))
    raw = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(value.data_ptr())) if count else np.empty(0)
    return raw.astype(np.uint16, copy=True).view(ml_dtypes.bfloat16).reshape(shape)


def _joined(requests: list[InferenceRequest]) -> dict[str, list[np.ndarray]]:
    """Each input's arrays from every request, by name (a request may leave optional inputs out, in any order)."""
    columns: dict[str, list[np.ndarray]] = {t.name: [] for t in requests[0].inputs}
    for request in requests:
        for tensor in request.inputs:
            column = columns.get(tensor.name)
            if column is None:
                _refuse_mixed(requests)
            column.append(tensor.data)
    if any(len(parts) != len(requests) for parts in columns.values()):  # some request left an input out
        _refuse_mixed(requests)
    return columns


def _refuse_mixed(requests: list[InferenceRequest]) -> NoReturn:
    """A scheduler batches only requests that carry the same inputs; joining others would feed one's to another."""
    carried = sorted({tuple(t.name for t in r.inputs) for r in requests})
    raise InternalError(f"the requests of one batch carry different inputs {carried}; they cannot run together")


def _requested_names(request: InferenceRequest, every: tuple[str, ...]) -> list[str]:
    if request.outputs is None:
        return list(every)
    return [o.name for o in request.outputs]


def _decode_strings(name: str, array: np.ndarray) -> np.ndarray:
    """ONNX Runtime string tensors hold str, while the wire carries bytes."""
    try:
        decoded = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"input '{name}' holds bytes that are not UTF-8 text: {exc}") from None
    return np.array(decoded, dtype=object).reshape(array.shape)
