"""What the GE backend loads: `model.onnx`, a compiled `model.gem`, or a source compiled on first load (`model.onnx`
with compile_* parameters, a TensorFlow `model.savedmodel/` or `model.graphdef`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geserve.backends.ge.parameters import custom_op_libraries
from geserve.compiler import CompileOptions, CompilerError
from geserve.compiler.package import is_package, load_key, read_manifest, read_package
from geserve.compiler.tensorflow import is_tensorflow_model, model_kind
from geserve.config import ModelConfig
from geserve.errors import InvalidArgumentError, UnavailableError

logger = logging.getLogger(__name__)

PACKAGE_FILENAME = "model.gem"
# Triton's default model file names of the platforms the GE backend serves, by platform.
DEFAULT_SOURCES = {
    "onnxruntime_onnx": "model.onnx",
    "tensorflow_savedmodel": "model.savedmodel",
    "tensorflow_graphdef": "model.graphdef",
}
# config.pbtxt parameters that ask for compile-on-first-load, and the CompileOptions field each sets.
COMPILE_PARAMETERS = {
    "compile_precision_mode": "precision_mode",
    "compile_dynamic_batch_size": "batch_gears",
    "compile_quantize": "quantize",
    "compile_calibration_data": "calibration_data",
    "compile_input_shape": "input_shapes",
    "compile_out_nodes": "out_nodes",
    "compile_insert_op_conf": "insert_op_conf",
    "compile_target": "target",
    "compile_keep_fp32": "keep_fp32",  # names, or @file relative to the model folder
}


def find_package(version_dir: Path, configured: str) -> Path | None:
    """The compiled package to load: the configured file if it is one, else `model.gem` when the config names
    no file of its own (or one of Triton's default source names): a compiled model wins over its source."""
    named = version_dir / configured if configured else None
    if named is not None and named.is_file() and is_package(named):
        return named
    if configured not in ("", *DEFAULT_SOURCES.values()):
        return None
    fallback = version_dir / PACKAGE_FILENAME
    return fallback if fallback.is_file() and is_package(fallback) else None


def compile_on_load(config: ModelConfig, source_path: Path, model_dir: Path) -> Path:
    """The cached `.gem` for `source_path` under the config's compile_* options, compiling it the first time."""
    from geserve.compiler.cache import compile_cached

    try:
        # A compile on load registers the model's `custom_ops` libraries as serving does.
        value = config.parameters["custom_ops"].string_value if "custom_ops" in config.parameters else ""
        libraries = [model_dir / library for library in custom_op_libraries(value)]
        options = CompileOptions(model=source_path, custom_op_libraries=libraries,
                                 **_compile_fields(config, source_path, model_dir))
        started = time.perf_counter()
        path, hit = compile_cached(options)
    except CompilerError as exc:
        raise InvalidArgumentError(f"model '{config.name}': compile on load failed: {exc}") from None
    # A Triton TensorFlow model runs on ONNX Runtime here: its log line says so.
    served = f" (platform '{config.platform}', converted to ONNX)" if is_tensorflow_model(source_path) else ""
    if hit:
        logger.info("model '%s'%s: using cached compiled model %s", config.name, served, path)
    else:
        logger.info("model '%s'%s: compiled %s into %s in %.1f s", config.name, served, source_path, path,
                    time.perf_counter() - started)
    return path


def _compile_fields(config: ModelConfig, source_path: Path, model_dir: Path) -> dict[str, Any]:
    """CompileOptions keyword arguments (of several types) from the config's compile_* parameters; a TensorFlow
    source also takes Triton's TF_SIGNATURE_DEF and, for a GraphDef, its tensors from the config's inputs/outputs."""
    values = {key: config.parameters[key].string_value for key in COMPILE_PARAMETERS if key in config.parameters}
    fields: dict[str, Any] = {}
    for key, value in values.items():
        name = COMPILE_PARAMETERS[key]
        fields[name] = _FIELD_PARSERS.get(name, _stripped)(value, key, model_dir)
    if not is_tensorflow_model(source_path):
        return {"framework": "onnx", **fields}
    _add_tensorflow_fields(config, source_path, fields)
    return fields


def _add_tensorflow_fields(config: ModelConfig, source_path: Path, fields: dict[str, Any]) -> None:
    if "TF_SIGNATURE_DEF" in config.parameters:
        fields.setdefault("signature", config.parameters["TF_SIGNATURE_DEF"].string_value.strip())
    if model_kind(source_path) == "graphdef":  # a frozen graph names no inputs or outputs: Triton's config does
        batch = [-1] if config.max_batch_size > 0 else []
        fields.setdefault("input_shapes", {t.name: [*batch, *t.dims] for t in config.input})
        fields.setdefault("out_nodes", [t.name for t in config.output])


# Each parser takes a compile_* parameter's text, the parameter's name and the model folder.
def _int_list(value: str, key: str, model_dir: Path) -> list[int]:
    from geserve.compiler.options import parse_int_list

    return parse_int_list(value, key)


def _input_shapes(value: str, key: str, model_dir: Path) -> dict[str, list[int]]:
    from geserve.compiler.options import parse_input_shapes

    return parse_input_shapes(value)


def _names(value: str, key: str, model_dir: Path) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def _model_file(value: str, key: str, model_dir: Path) -> Path:
    return model_dir / value


def _keep_fp32(value: str, key: str, model_dir: Path) -> list[str]:
    from geserve.compiler.keep import parse_keep_fp32

    return parse_keep_fp32(value, model_dir)


def _stripped(value: str, key: str, model_dir: Path) -> str:
    return value.strip()


# CompileOptions field -> its parser; any other field takes the text as it is, stripped.
_FIELD_PARSERS: dict[str, Callable[[str, str, Path], Any]] = {
    "batch_gears": _int_list,
    "input_shapes": _input_shapes,
    "out_nodes": _names,
    "calibration_data": _model_file,
    "insert_op_conf": _model_file,
    "keep_fp32": _keep_fp32,
}


def package_libraries(path: Path) -> list[str]:
    """The custom-op libraries a compiled package needs, relative to the model folder; none for a plain graph."""
    return list(read_manifest(path).custom_op_libraries) if is_package(path) else []


def wants_compile(config: ModelConfig, source_path: Path) -> bool:
    """A TensorFlow source is always compiled (converted); an ONNX one when a compile_* parameter asks."""
    return is_tensorflow_model(source_path) or any(key in config.parameters for key in COMPILE_PARAMETERS)


def apply_gears(config: ModelConfig, path: Path) -> None:
    """A compiled model's batch gears become the `batch_gears` parameter unless the config sets its own."""
    if not is_package(path) or "batch_gears" in config.parameters:
        return
    gears = [g for g in read_manifest(path).batch_gears if config.max_batch_size == 0 or g <= config.max_batch_size]
    if gears and config.max_batch_size > 0:
        config.parameters["batch_gears"].string_value = ",".join(str(g) for g in gears)


def load_graph(path: Path, key_file: str | None) -> Path | bytes:
    """What ONNX Runtime opens: a plain graph's path, or a package's decrypted bytes (never written to disk)."""
    if not is_package(path):
        return path
    try:
        _, onnx_bytes = read_package(path, load_key(key_file))
    except CompilerError as exc:
        raise UnavailableError(str(exc)) from None
    return onnx_bytes
