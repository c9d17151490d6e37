"""Precision modes named as in ATC: FP32 kept, FP16 everywhere, or FP16 with sensitive ops kept in FP32."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx

from geserve.compiler.custom_ops import custom_node_names
from geserve.compiler.errors import CompilerError
from geserve.compiler.keep import kept_nodes_and_ops

# Ops whose FP16 results lose too much (reductions, exponentials, normalizations): allow_mix_precision keeps them.
SENSITIVE_OPS = [
    "Softmax", "LogSoftmax", "LayerNormalization", "ReduceMean", "ReduceSum", "ReduceL2", "Exp", "Log", "Pow",
    "Sqrt", "Div", "Erf", "ArgMax", "ArgMin", "TopK", "NonMaxSuppression", "Range", "Resize",
]


def apply_precision(
    model: onnx.ModelProto, mode: str, keep_io_types: bool, custom_op_libraries: Sequence[Path] = (),
    keep_fp32: Sequence[str] = (),
) -> onnx.ModelProto:
    """`keep_fp32`: node names or op types left in FP32 (keep.py)."""
    if mode in ("force_fp32", "must_keep_origin_dtype"):
        return model
    try:
        from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    except ImportError as exc:
        raise CompilerError(f"FP16 conversion needs onnxruntime.transformers.float16: {exc}") from None
    # force_fp16 converts every op that has an FP16 kernel; the default block list holds the ops that do not.
    block = list(DEFAULT_OP_BLOCK_LIST)
    if mode == "allow_mix_precision":
        block += SENSITIVE_OPS
    from geserve.compiler.shapes import complete_types

    # Custom ops stay FP32: a library's kernels are FP32 as a rule, and which have FP16 ones is not discoverable;
    # the converter casts around them, the rest of the graph goes to FP16.
    custom_nodes = custom_node_names(model)
    kept_nodes, kept_ops = kept_nodes_and_ops(model, list(keep_fp32))
    try:
        return convert_float_to_float16(
            complete_types(model, custom_op_libraries), keep_io_types=keep_io_types, op_block_list=block + kept_ops,
            node_block_list=custom_nodes + kept_nodes, disable_shape_infer=False,
        )
    except Exception as exc:
        raise CompilerError(f"FP16 conversion failed: {str(exc).splitlines()[0]}") from None
