"""INT8 post-training static quantization with ONNX Runtime's quantizer and calibration data.

Calibration data: a folder of `.npy` files (each a batch for the single input) or `.npz` files (one array
per input name), or a Python callable named `path/to/file.py:function` or `package.module:function` that
returns an iterable of arrays (single input) or of {input name: array} dicts. QOperator (QLinearConv, ...)
is the fast form on CPU; QDQ is what TensorRT / CANN expect.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx

from geserve.compiler.errors import CompilerError
from geserve.compiler.shapes import complete_types, dims_of, graph_inputs

_MAX_ROWS = 32  # rows per calibration run: bounds the memory of collecting activations


def calibration_batches(folder: Path, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    inputs = graph_inputs(model)
    if not Path(folder).exists() and ":" in str(folder):
        return [chunk for feed in _from_callable(str(folder), inputs) for chunk in _split_rows(feed, inputs)]
    files = sorted(p for p in Path(folder).glob("*") if p.suffix in (".npy", ".npz")) if folder.is_dir() else []
    if not files:
        raise CompilerError(f"--calibration-data {folder} holds no .npy or .npz files")
    batches: list[dict[str, np.ndarray]] = []
    for path in files:
        batches.extend(_split_rows(_file_feed(path, inputs), inputs))
    return batches


def _file_feed(path: Path, inputs: list[onnx.ValueInfoProto]) -> dict[str, np.ndarray]:
    """One calibration file's arrays by input name: a `.npy` for the single input, a `.npz` naming every input."""
    if path.suffix == ".npy":
        if len(inputs) != 1:
            raise CompilerError(f"{path}: a .npy file feeds one input; the graph has {len(inputs)}, use .npz")
        return {inputs[0].name: np.load(path)}
    with np.load(path) as archive:
        feed = {value.name: archive[value.name] for value in inputs if value.name in archive}
    missing = [v.name for v in inputs if v.name not in feed]
    if missing:
        raise CompilerError(f"{path} lacks array(s) for input(s) {missing}")
    return feed


def _from_callable(spec: str, inputs: list[onnx.ValueInfoProto]) -> Iterator[dict[str, np.ndarray]]:
    import importlib
    import importlib.util

    module_ref, _, name = spec.rpartition(":")
    try:
        if module_ref.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location("geserve_calibration", module_ref)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load {module_ref}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_ref)
        produce = getattr(module, name)
    except (ImportError, AttributeError, OSError, SyntaxError) as exc:
        raise CompilerError(f"--calibration-data {spec}: cannot load the calibration callable: {exc}") from None
    for item in produce():
        if isinstance(item, np.ndarray):
            if len(inputs) != 1:
                raise CompilerError(f"--calibration-data {spec} yielded an array; the graph has {len(inputs)} inputs")
            yield {inputs[0].name: item}
        elif isinstance(item, dict):
            yield {key: np.asarray(value) for key, value in item.items()}
        else:
            raise CompilerError(f"--calibration-data {spec} must yield arrays or dicts, got {type(item).__name__}")


def _split_rows(feed: dict[str, np.ndarray], inputs: list[onnx.ValueInfoProto]) -> Iterator[dict[str, np.ndarray]]:
    """Cut each file into runs the graph accepts: its static batch size, else at most _MAX_ROWS rows."""
    for value in inputs:
        dims = dims_of(value)
        array = feed[value.name]
        if array.ndim == len(dims) - 1:
            feed[value.name] = array[None]
    first = dims_of(inputs[0])[:1]
    step = first[0] if first and first[0] > 0 else _MAX_ROWS
    rows = len(next(iter(feed.values())))
    for start in range(0, rows, step):
        chunk = {name: np.ascontiguousarray(array[start:start + step]) for name, array in feed.items()}
        if len(next(iter(chunk.values()))) == step or first != [step]:
            yield chunk


def quantize_int8(
    model: onnx.ModelProto, folder: Path, target: str, per_channel: bool, keep_fp32: Sequence[str] = ()
) -> onnx.ModelProto:
    """`keep_fp32`: node names or op types left in FP32 (keep.py)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from geserve.compiler.keep import excluded_nodes

    model = complete_types(model)
    excluded = excluded_nodes(model, list(keep_fp32))
    batches = calibration_batches(folder, model)
    types = {value.name: onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
             for value in graph_inputs(model)}

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else {k: v.astype(types[k], copy=False) for k, v in batch.items()}

    cpu = target == "cpu"
    with tempfile.TemporaryDirectory(prefix="geserve-quantize-") as scratch:
        output = Path(scratch) / "quantized.onnx"
        try:
            quantize_static(
                model,
                output,
                Reader(),
                quant_format=QuantFormat.QOperator if cpu else QuantFormat.QDQ,
                per_channel=per_channel,
                nodes_to_exclude=excluded,
                # u8 activations x s8 weights is the fast x86 path; reduce_range avoids AVX2's u8s8 saturation.
                reduce_range=cpu,
                activation_type=QuantType.QUInt8 if cpu else QuantType.QInt8,
                weight_type=QuantType.QInt8,
                extra_options={"ActivationSymmetric": not cpu, "WeightSymmetric": True},
            )
            return onnx.load(str(output))
        except CompilerError:
            raise
        except Exception as exc:
            raise CompilerError(f"INT8 quantization failed: {str(exc).splitlines()[0]}") from None
