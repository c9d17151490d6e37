"""Graph optimization through ONNX Runtime's offline optimizer: constant folding and operator fusion."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnxruntime as ort

from geserve.compiler.custom_ops import session_options
from geserve.compiler.errors import CompilerError

# The highest level whose saved graph still runs on the target: EXTENDED fusions are CPU-EP contrib ops
# (portable across x86/ARM CPUs, unlike ALL's NCHWc layouts); TensorRT and CANN want standard ONNX ops.
LEVELS = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
}
TARGET_LEVEL = {"cpu": "extended", "cuda": "basic", "npu": "basic"}


def optimize(model: onnx.ModelProto, level: str, custom_op_libraries: Sequence[Path] = ()) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory(prefix="geserve-compile-") as scratch:
        target = Path(scratch) / "optimized.onnx"
        options = session_options(custom_op_libraries)
        options.graph_optimization_level = LEVELS[level]
        options.optimized_model_filepath = str(target)
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            return onnx.load(str(target))
        except Exception as exc:
            raise CompilerError(f"ONNX Runtime could not optimize the graph: {str(exc).splitlines()[0]}") from None
