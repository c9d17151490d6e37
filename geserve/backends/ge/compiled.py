"""What the GE backend loads: `model.onnx`, a compiled `model.gem`, or `model.onnx` compiled on first load."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from geserve.compiler import CompileOptions, CompilerError
from geserve.compiler.package import is_package, load_key, read_manifest, read_package
from geserve.config import ModelConfig
from geserve.errors import InvalidArgumentError, UnavailableError

logger = logging.getLogger(__name__)

PACKAGE_FILENAME = "model.gem"
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
}


def find_package(version_dir: Path, configured: str) -> Path | None:
    """The compiled package to load: the configured file if it is one, else `model.gem` when the config names
    no file of its own (or Triton's default `model.onnx`): a compiled model wins over its source."""
    named = version_dir / configured if configured else None
    if named is not None and named.is_file() and is_package(named):
        return named
    if configured not in ("", "model.onnx"):
        return None
    fallback = version_dir / PACKAGE_FILENAME
    return fallback if fallback.is_file() and is_package(fallback) else None


def compile_on_load(config: ModelConfig, source_path: Path, model_dir: Path) -> Path:
    """The cached `.gem` for `source_path` under the config's compile_* options, compiling it the first time."""
    from geserve.compiler.cache import compile_cached
    from geserve.compiler.options import parse_input_shapes, parse_int_list

    values = {key: config.parameters[key].string_value for key in COMPILE_PARAMETERS if key in config.parameters}
    fields: dict[str, Any] = {}  # CompileOptions keyword arguments, of several types
    try:
        for key, value in values.items():
            name = COMPILE_PARAMETERS[key]
            if name == "batch_gears":
                fields[name] = parse_int_list(value, key)
            elif name == "input_shapes":
                fields[name] = parse_input_shapes(value)
            elif name == "out_nodes":
                fields[name] = [n.strip() for n in value.split(",") if n.strip()]
            elif name in ("calibration_data", "insert_op_conf"):
                fields[name] = model_dir / value
            else:
                fields[name] = value.strip()
        started = time.perf_counter()
        path, hit = compile_cached(CompileOptions(model=source_path, framework="onnx", **fields))
    except CompilerError as exc:
        raise InvalidArgumentError(f"model '{config.name}': compile on load failed: {exc}") from None
    if hit:
        logger.info("model '%s': using cached compiled model %s", config.name, path)
    else:
        logger.info("model '%s': compiled %s into %s in %.1f s", config.name, source_path, path,
                    time.perf_counter() - started)
    return path


def wants_compile(config: ModelConfig) -> bool:
    return any(key in config.parameters for key in COMPILE_PARAMETERS)


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
