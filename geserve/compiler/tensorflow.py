"""The TensorFlow front end: SavedModel folders, frozen GraphDefs and Keras files to ONNX, in a child process.

The conversion runs `geserve.compiler.tf_convert` under this interpreter, so neither `geserve compile` nor a server
compiling on first load keeps TensorFlow imported (seconds to import, hundreds of MB, its own thread pools).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

import onnx

from geserve.compiler.errors import CompilerError, MissingDependencyError
from geserve.compiler.tf_convert import ERROR_PREFIX

# Triton's file names for TensorFlow models (a SavedModel folder, a frozen GraphDef) and the usual suffixes.
GRAPHDEF_SUFFIXES = (".pb", ".graphdef")
KERAS_SUFFIXES = (".keras", ".h5")
CONVERSION_TIMEOUT_S = 3600.0


def is_saved_model(path: Path) -> bool:
    return path.is_dir() and (path / "saved_model.pb").is_file()


def is_tensorflow_model(path: Path) -> bool:
    return is_saved_model(path) or path.suffix.lower() in GRAPHDEF_SUFFIXES + KERAS_SUFFIXES


def model_kind(path: Path) -> str:
    if path.is_dir():
        if not is_saved_model(path):
            raise CompilerError(f"{path} is a folder without saved_model.pb: not a TensorFlow SavedModel")
        return "saved_model"
    return "keras" if path.suffix.lower() in KERAS_SUFFIXES else "graphdef"


def from_tensorflow(
    path: Path, input_shapes: dict[str, list[int]], out_nodes: list[str], signature: str = ""
) -> onnx.ModelProto:
    """A SavedModel (its `signature`, else serving_default), a frozen GraphDef (inputs named by `input_shapes`,
    outputs by `out_nodes`, as atc takes them) or a Keras file, converted by tf2onnx."""
    for package in ("tensorflow", "tf2onnx"):
        if find_spec(package) is None:
            raise MissingDependencyError(package, "tensorflow", "the TensorFlow front end")
    with tempfile.TemporaryDirectory(prefix="geserve-tf-") as scratch:
        output = Path(scratch) / "model.onnx"
        request = {
            "kind": model_kind(path), "model": str(path.resolve()), "output": str(output), "signature": signature,
            "inputs": list(input_shapes), "input_shapes": input_shapes, "outputs": list(out_nodes),
        }
        request_file = Path(scratch) / "request.json"
        request_file.write_text(json.dumps(request))
        _run_child(request_file, path)
        return onnx.load(str(output))


def _run_child(request_file: Path, path: Path) -> None:
    # TensorFlow's C++ log lines and any GPU it could claim are not the compile's business: tf2onnx converts on the
    # CPU, and a GPU build of TensorFlow would otherwise reserve device memory a served model needs.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "geserve.compiler.tf_convert", str(request_file)], env=env,
            capture_output=True, text=True, timeout=CONVERSION_TIMEOUT_S, check=False,
        )
    except subprocess.TimeoutExpired:
        raise CompilerError(f"converting {path} with tf2onnx took over {CONVERSION_TIMEOUT_S:.0f} s") from None
    if done.returncode == 0:
        return
    ours = [line[len(ERROR_PREFIX):] for line in done.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    if ours:
        raise CompilerError(ours[-1])
    last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or [f"exit {done.returncode}"]
    raise CompilerError(f"converting {path} with tf2onnx failed: {last[0]}")
