"""Precision modes named as in ATC: FP32 kept, FP16 everywhere, or FP16 with sensitive ops kept in FP32."""

from __future__ import annotations

import onnx

from geserve.compiler.errors import CompilerError

# Ops whose FP16 results lose too much (reductions, exponentials, normalizations): allow_mix_precision keeps them.
SENSITIVE_OPS = [
    "Softmax", "LogSoftmax", "LayerNormalization", "ReduceMean", "ReduceSum", "ReduceL2", "Exp", "Log", "Pow",
    "Sqrt", "Div", "Erf", "ArgMax", "ArgMin", "TopK", "NonMaxSuppression", "Range", "Resize",
]


def apply_precision(model: onnx.ModelProto, mode: str, keep_io_types: bool) -> onnx.ModelProto:
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

    try:
        return convert_float_to_float16(
            complete_types(model), keep_io_types=keep_io_types, op_block_list=block, disable_shape_infer=False
        )
    except Exception as exc:
        raise CompilerError(f"FP16 conversion failed: {str(exc).splitlines()[0]}") from None
