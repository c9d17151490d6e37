"""The execution-provider options of a GE model's sessions, from its config: CUDA's from its parameters, TensorRT's
from Triton's `gpu_execution_accelerator` entry and its precision settings (engine cache included), CANN's from the
GE dialects. geserve.devices does the mapping; this module only gathers what the config says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from geserve.backends.ge.autocomplete import read_signature
from geserve.backends.ge.parameters import GeOptions
from geserve.compiler.package import Manifest, is_package, read_manifest
from geserve.config import ModelConfig
from geserve.devices import cann, cuda, tensorrt
from geserve.devices.target import CANN_PROVIDER, CUDA_PROVIDER, TENSORRT_PROVIDER
from geserve.errors import InvalidArgumentError

_GPU_ACCELERATORS = ("tensorrt", "cuda")


def configured_accelerator(config: ModelConfig) -> str | None:
    """"tensorrt" when the config asks for Triton's TensorRT accelerator on GPU instances, else None."""
    names = [a.name.lower() for a in _gpu_accelerators(config)]
    unknown = [n for n in names if n not in _GPU_ACCELERATORS]
    if unknown:
        raise InvalidArgumentError(
            f"model '{config.name}': unknown gpu_execution_accelerator '{unknown[0]}'; geserve offers "
            + ", ".join(_GPU_ACCELERATORS)
        )
    return "tensorrt" if "tensorrt" in names else None


def provider_options(
    config: ModelConfig, options: GeOptions, family: str, path: Path, graph: Path | bytes
) -> dict[str, dict[str, str]]:
    """Options by provider name for instances on `family` ("cpu", "cuda", "tensorrt", "npu")."""
    result: dict[str, dict[str, str]] = {}
    if family in ("cuda", "tensorrt"):
        graphs = config.optimization.cuda.graphs if config.HasField("optimization") else False
        cuda_options = cuda.cuda_options(options.device_parameters, graphs)
        cuda_options.update(_accelerator_parameters(config, "cuda"))
        result[CUDA_PROVIDER] = cuda_options
    if family == "tensorrt":
        result[TENSORRT_PROVIDER] = _tensorrt_options(config, path, graph)
    if family == "npu":
        result[CANN_PROVIDER] = cann.cann_options(options.ge_options, options.device_parameters, options.dump_graph)
    return result


def _tensorrt_options(config: ModelConfig, path: Path, graph: Path | bytes) -> dict[str, str]:
    parameters = _accelerator_parameters(config, "tensorrt")
    manifest = read_manifest(path) if is_package(path) else None
    precision = _precision(config, parameters, manifest)
    max_batch = _max_batch(config)
    inputs = [(t.name, t.shape) for t in read_signature(path)[0]]
    engine = tensorrt.engine_options(parameters)
    # An encrypted model's engine would hold its weights in the clear on disk: no cache for it.
    cache = not (manifest is not None and manifest.encrypted)
    return tensorrt.tensorrt_options(
        tensorrt.graph_digest(graph), precision, tensorrt.profile_shapes(inputs, max_batch), engine, cache
    )


def _precision(config: ModelConfig, parameters: dict[str, str], manifest: Manifest | None) -> str:
    """The engine's precision: the accelerator's `precision_mode`, else the compile's (the config's parameter, or
    what the package was compiled with)."""
    compile_precision = (
        config.parameters["compile_precision_mode"].string_value if "compile_precision_mode" in config.parameters
        else (manifest.precision if manifest else "")
    )
    return tensorrt.precision_of(
        parameters.get("precision_mode", ""), compile_precision, manifest.quantization if manifest else ""
    )


def _max_batch(config: ModelConfig) -> int:
    """The largest batch an engine profile covers: the largest gear, else the config's max_batch_size."""
    gears = [int(g) for g in config.parameters["batch_gears"].string_value.split(",") if g.strip()] \
        if "batch_gears" in config.parameters else []
    return max(gears) if gears else config.max_batch_size


def _gpu_accelerators(config: ModelConfig) -> list[Any]:  # ModelOptimizationPolicy...Accelerator messages
    if not config.HasField("optimization"):
        return []
    return list(config.optimization.execution_accelerators.gpu_execution_accelerator)


def _accelerator_parameters(config: ModelConfig, name: str) -> dict[str, str]:
    for accelerator in _gpu_accelerators(config):
        if accelerator.name.lower() == name:
            return dict(accelerator.parameters)
    return {}
