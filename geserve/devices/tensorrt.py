"""TensorRT execution provider options: precision from the model's settings, optimization profiles over the batch
range, and an engine cache on disk keyed like the compiler's cache (the graph's content hash and every option that
changes the engine), so a second load deserializes the engine instead of building it.

Triton's onnxruntime backend names: `optimization { execution_accelerators { gpu_execution_accelerator: [ { name:
"tensorrt" parameters { key: "precision_mode" value: "FP16" } ... } ] } }` with `precision_mode` (FP32, FP16,
INT8), `max_workspace_size_bytes`, `trt_max_partition_iterations`, `trt_min_subgraph_size`, `trt_engine_cache_*`;
any `trt_*` key is ONNX Runtime's own option and passes through.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from geserve.cachekeys import cache_dir, file_hash
from geserve.errors import InvalidArgumentError, UnavailableError

PRECISIONS = ("fp32", "fp16", "int8")
# The compiler's precision modes that allow FP16 kernels (atc's names, also compile_precision_mode).
_FP16_MODES = {"force_fp16", "allow_fp32_to_fp16", "allow_mix_precision"}
_TRITON_NAMES = {"max_workspace_size_bytes": "trt_max_workspace_size"}
_MANAGED = {"trt_fp16_enable", "trt_int8_enable", "trt_engine_cache_enable", "trt_engine_cache_path",
            "trt_timing_cache_enable", "trt_timing_cache_path", "trt_profile_min_shapes", "trt_profile_opt_shapes",
            "trt_profile_max_shapes"}


def precision_of(accelerator_precision: str = "", compile_precision: str = "", quantization: str = "") -> str:
    """fp32 / fp16 / int8 from Triton's `precision_mode`, else the compile precision mode, else a .gem's manifest."""
    if accelerator_precision:
        wanted = accelerator_precision.strip().lower()
        if wanted not in PRECISIONS:
            raise InvalidArgumentError(
                f"TensorRT precision_mode '{accelerator_precision}' is not one of FP32, FP16, INT8"
            )
        return wanted
    if quantization == "int8":
        return "int8"
    return "fp16" if compile_precision in _FP16_MODES else "fp32"


def graph_digest(graph: Path | bytes) -> str:
    return hashlib.sha256(graph).hexdigest() if isinstance(graph, bytes) else file_hash(graph)


def profile_shapes(inputs: Sequence[tuple[str, Sequence[int]]], max_batch: int) -> dict[str, str]:
    """One optimization profile over batch 1 .. max_batch (opt = max) when the batch dimension, and only it, is
    dynamic in every input; {} otherwise (TensorRT then builds for the shapes it meets)."""
    if max_batch <= 0 or not inputs:
        return {}
    if any(not shape or shape[0] >= 0 or any(d < 0 for d in shape[1:]) for _, shape in inputs):
        return {}

    def spec(batch: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in (batch, *shape[1:]))}" for name, shape in inputs)

    return {"trt_profile_min_shapes": spec(1), "trt_profile_opt_shapes": spec(max_batch),
            "trt_profile_max_shapes": spec(max_batch)}


def engine_options(parameters: Mapping[str, str]) -> dict[str, str]:
    """The accelerator's parameters as ONNX Runtime options (precision_mode and the cache settings excluded)."""
    options: dict[str, str] = {}
    for key, value in parameters.items():
        name = _TRITON_NAMES.get(key, key)
        if key == "precision_mode" or name in _MANAGED:
            continue
        if not name.startswith("trt_"):
            raise InvalidArgumentError(
                f"unknown TensorRT accelerator parameter '{key}'; expected precision_mode, max_workspace_size_bytes "
                "or an ONNX Runtime trt_* option"
            )
        options[name] = value.strip()
    return options


def engine_cache_path(digest: str, precision: str, profiles: Mapping[str, str], options: Mapping[str, str],
                      root: Path | None = None) -> Path:
    """The folder of this graph's engines under these settings: <cache>/tensorrt/<key>."""
    text = json.dumps([digest, precision, dict(profiles), dict(options), ort.__version__], sort_keys=True)
    key = hashlib.sha256(text.encode()).hexdigest()[:40]
    return (root or cache_dir()) / "tensorrt" / key


def tensorrt_options(
    digest: str,
    precision: str,
    profiles: Mapping[str, str],
    options: Mapping[str, str],
    cache: bool = True,
    root: Path | None = None,
) -> dict[str, str]:
    """TensorrtExecutionProvider options (device_id excepted). `cache` False (an encrypted model: its engine would be
    its weights in the clear on disk) builds the engine on every load."""
    result = {**options, **profiles, "trt_fp16_enable": "1" if precision in ("fp16", "int8") else "0",
              "trt_int8_enable": "1" if precision == "int8" else "0"}
    if cache:
        path = engine_cache_path(digest, precision, profiles, options, root)
        path.mkdir(parents=True, exist_ok=True)
        result.update(trt_engine_cache_enable="1", trt_engine_cache_path=str(path),
                      trt_timing_cache_enable="1", trt_timing_cache_path=str(path))
    return result


def prepare_engine_cache(
    graph: Path | bytes, precision: str, max_batch: int, options: Mapping[str, str] | None = None,
    device_id: int = 0, root: Path | None = None,
) -> Path:
    """Build the engine once (a session and one run at the largest batch) so that loads find it in the cache."""
    _require_tensorrt()
    source: Any = graph if isinstance(graph, bytes) else str(graph)
    probe = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    inputs = [(i.name, [d if isinstance(d, int) else -1 for d in i.shape]) for i in probe.get_inputs()]
    profiles = profile_shapes(inputs, max_batch)
    digest = graph_digest(graph)
    extra = dict(options or {})
    trt = {"device_id": str(device_id), **tensorrt_options(digest, precision, profiles, extra, root=root)}
    session = ort.InferenceSession(
        source, providers=[("TensorrtExecutionProvider", trt), ("CUDAExecutionProvider", {"device_id": device_id})]
    )
    session.run(None, _zeros_feed(probe.get_inputs(), max_batch if profiles else 1))
    return Path(trt["trt_engine_cache_path"])


def _require_tensorrt() -> None:
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        raise UnavailableError(
            "the TensorRT engine cache needs onnxruntime's TensorrtExecutionProvider (geserve[cuda] with TensorRT "
            f"on a machine with an NVIDIA GPU); this onnxruntime has {', '.join(ort.get_available_providers())}"
        )


def _zeros_feed(inputs: Sequence[Any], batch: int) -> dict[str, np.ndarray]:
    """Zeros for each session input (a NodeArg): a dynamic first dimension at `batch`, any other dynamic one at 1."""
    feed = {}
    for value in inputs:
        shape = [batch if i == 0 and (not isinstance(d, int) or d < 0) else (d if isinstance(d, int) and d > 0 else 1)
                 for i, d in enumerate(value.shape)]
        feed[value.name] = np.zeros(shape, _NUMPY_TYPES.get(value.type, np.float32))
    return feed


_NUMPY_TYPES: dict[str, Any] = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
    "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
    "tensor(double)": np.float64,
}
