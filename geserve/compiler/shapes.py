"""Shape passes: fix input dimensions (--input-shape), check batch gears, cut the graph at --out-nodes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import onnx
from onnx import shape_inference

from geserve.compiler.errors import CompilerError


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {init.name for init in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initializers]


def dims_of(value: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]


def signature(values: Iterable[onnx.ValueInfoProto]) -> dict[str, dict[str, Any]]:
    return {
        v.name: {
            "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type),
            "onnx_type": v.type.tensor_type.elem_type,
            "shape": dims_of(v),
        }
        for v in values
    }


def cut_outputs(model: onnx.ModelProto, out_nodes: list[str]) -> onnx.ModelProto:
    """Keep only what computes the named tensors (a node name stands for its first output)."""
    if not out_nodes:
        return model
    outputs = _out_tensors(model, out_nodes)
    try:
        inferred = shape_inference.infer_shapes(model)
        return onnx.utils.Extractor(inferred).extract_model([v.name for v in graph_inputs(model)], outputs)
    except Exception as exc:
        raise CompilerError(f"--out-nodes: cannot cut the graph at {outputs}: {exc}") from None


def _out_tensors(model: onnx.ModelProto, out_nodes: list[str]) -> list[str]:
    """The tensor each --out-nodes name stands for."""
    by_node = {node.name: node.output[0] for node in model.graph.node if node.name and node.output}
    produced = {name for node in model.graph.node for name in node.output}
    outputs = []
    for name in out_nodes:
        tensor = name if name in produced else by_node.get(name)
        if tensor is None:
            raise CompilerError(f"--out-nodes: '{name}' is neither a tensor nor a node of the graph")
        outputs.append(tensor)
    return outputs


def fix_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]], gears: list[int]) -> onnx.ModelProto:
    inputs = {value.name: value for value in graph_inputs(model)}
    for name, shape in shapes.items():
        value = inputs.get(name)
        if value is None:
            raise CompilerError(f"--input-shape names '{name}', but the graph inputs are {sorted(inputs)}")
        _fix_input_shape(name, value, shape)
    if gears:
        _check_dynamic_batch(inputs.values())
    if shapes:
        return _infer_fixed_shapes(model)
    return model


def _fix_input_shape(name: str, value: onnx.ValueInfoProto, shape: list[int]) -> None:
    """Set the sizes `shape` gives (-1: leave dynamic) on the graph input `value`."""
    dims = value.type.tensor_type.shape.dim
    if len(dims) != len(shape):
        raise CompilerError(f"--input-shape gives '{name}' {len(shape)} dimensions; the graph has {len(dims)}")
    for dim, size, current in zip(dims, shape, dims_of(value), strict=True):
        if size == -1:
            if current != -1:
                raise CompilerError(f"--input-shape: dimension of '{name}' is fixed at {current} in the graph")
            continue
        if current not in (-1, size):
            raise CompilerError(f"--input-shape: '{name}' has {dims_of(value)} in the graph, cannot be {shape}")
        dim.Clear()
        dim.dim_value = size


def _check_dynamic_batch(inputs: Iterable[onnx.ValueInfoProto]) -> None:
    for value in inputs:
        first = dims_of(value)[:1]
        if first != [-1]:
            raise CompilerError(
                f"--dynamic-batch-size needs a dynamic first dimension; input '{value.name}' has {dims_of(value)}"
            )


def _infer_fixed_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    # The intermediate shapes there were inferred from the inputs' old dimensions.
    del model.graph.value_info[:]
    try:
        return shape_inference.infer_shapes(model)
    except Exception as exc:
        raise CompilerError(f"shape inference failed after fixing input shapes: {exc}") from None


def drop_identities(model: onnx.ModelProto) -> onnx.ModelProto:
    """Remove Identity nodes (exporters leave them before outputs; the quantizer trips over them)."""
    graph = model.graph
    fixed = {v.name for v in graph.input} | {i.name for i in graph.initializer}
    outputs = {v.name for v in graph.output}
    for node in [n for n in graph.node if n.op_type == "Identity" and n.domain in ("", "ai.onnx")]:
        renaming = _identity_renaming(node, fixed, outputs)
        if renaming is None:
            continue
        graph.node.remove(node)
        _rename_tensor(graph, *renaming)
    return model


def _identity_renaming(node: onnx.NodeProto, fixed: set[str], outputs: set[str]) -> tuple[str, str] | None:
    """(old, new): the name that goes and the one that stays when this Identity goes; None where it must stay (it
    joins a graph output to a graph input, an initializer, or another output)."""
    source, target = node.input[0], node.output[0]
    if target not in outputs:
        return target, source
    if source in fixed or source in outputs:
        return None
    return source, target


def _rename_tensor(graph: onnx.GraphProto, old: str, new: str) -> None:
    for other in graph.node:
        other.input[:] = [new if name == old else name for name in other.input]
        other.output[:] = [new if name == old else name for name in other.output]
    for value in list(graph.value_info):
        if value.name == old:
            graph.value_info.remove(value)


ORT_TYPES = {f"tensor({name})": value for name, value in (
    ("float", onnx.TensorProto.FLOAT), ("float16", onnx.TensorProto.FLOAT16), ("double", onnx.TensorProto.DOUBLE),
    ("int64", onnx.TensorProto.INT64), ("int32", onnx.TensorProto.INT32), ("int8", onnx.TensorProto.INT8),
    ("uint8", onnx.TensorProto.UINT8), ("bool", onnx.TensorProto.BOOL), ("string", onnx.TensorProto.STRING),
)}


def complete_types(model: onnx.ModelProto, custom_op_libraries: Sequence[Path] = ()) -> onnx.ModelProto:
    """Give every intermediate tensor a type, asking ONNX Runtime where ONNX's inference has none (ai.onnx.ml, custom
    ops)."""
    import onnxruntime as ort

    from geserve.compiler.custom_ops import session_options

    model = shape_inference.infer_shapes(model)
    graph = model.graph
    missing = _untyped(graph)
    if not missing:
        return model
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in missing)
    session = ort.InferenceSession(probe.SerializeToString(), session_options(custom_op_libraries),
                                   providers=["CPUExecutionProvider"])
    for output in session.get_outputs():
        if output.name in missing and output.type in ORT_TYPES:
            graph.value_info.append(_value_info(output))
    return model


def _untyped(graph: onnx.GraphProto) -> list[str]:
    """The node outputs the graph gives no type."""
    known = {v.name for v in [*graph.input, *graph.output, *graph.value_info]} | {i.name for i in graph.initializer}
    return [name for node in graph.node for name in node.output if name and name not in known]


def _value_info(output: Any) -> onnx.ValueInfoProto:
    """An ONNX Runtime session output (NodeArg) as a value info."""
    shape = [d if isinstance(d, int) else None for d in output.shape] if output.shape else None
    return onnx.helper.make_tensor_value_info(output.name, ORT_TYPES[output.type], shape)
