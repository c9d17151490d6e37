"""Layer-by-layer accuracy: the tensors a golden and an output graph both compute, matched by name (`match`) and
compared one by one in the golden's topological order, to find the first layer where the error jumps."""

from __future__ import annotations

import csv
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from geserve.compiler.compare import Comparison, compare
from geserve.compiler.errors import CompilerError

QUANTIZED_SUFFIX = "_quantized"  # ONNX Runtime's quantizer names a quantized activation X as X_quantized
# ONNX Runtime renames a tensor between two nodes it runs in FP32 in an FP16 graph (their Casts cancel out) thus.
_RENAMED_PREFIX = "InsertedPrecisionFreeCast_"
# Activations ONNX Runtime's QOperator quantizer removes after a quantized op (its output range already clips them).
_FOLDED_ACTIVATIONS = ("Relu", "Clip")


@dataclass(frozen=True, slots=True)
class LayerTensor:
    """One tensor a graph takes or computes, in the graph's topological order."""

    name: str
    node: str = ""  # the producing node ("" for a graph input)
    op_type: str = ""
    inputs: tuple[str, ...] = ()  # the producing node's inputs
    kind: str = "layer"  # "input", "layer", or "output" (a graph output)
    scale: float | None = None  # a quantized tensor's dequantization: (value - zero_point) * scale
    zero_point: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["inputs"] = list(self.inputs)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerTensor:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**known, "inputs": tuple(data.get("inputs", ()))})

    def value(self, array: np.ndarray) -> np.ndarray:
        """The array as the golden's counterpart: dequantized if this is a quantized tensor."""
        if self.scale is None:
            return array
        return (array.astype(np.float64) - self.zero_point) * self.scale


@dataclass(frozen=True, slots=True)
class Pair:
    golden: LayerTensor
    output: LayerTensor
    nodes: tuple[str, ...]  # the golden nodes this row covers: those computed since the previous compared tensors


@dataclass(frozen=True, slots=True)
class Row:
    pair: Pair
    result: Comparison


def describe(model: onnx.ModelProto) -> list[LayerTensor]:
    """The graph's inputs and every node output (Constant nodes left out), in topological order."""
    graph = model.graph
    constants = {i.name for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    quantized = _quantization_params(graph)
    tensors = [LayerTensor(i.name, kind="input") for i in graph.input if i.name not in constants]
    for node in graph.node:
        if node.op_type == "Constant":
            continue
        for name in filter(None, node.output):
            scale, zero_point = quantized.get(name, (None, 0))
            kind = "output" if name in outputs else "layer"
            tensors.append(LayerTensor(name, node.name, node.op_type, tuple(node.input), kind, scale, zero_point))
    return tensors


def _quantization_params(graph: onnx.GraphProto) -> dict[str, tuple[float, int]]:
    """Scale and zero point of each computed `X_quantized` tensor: the two inputs after it of an op that reads it
    quantized (QLinear* ops, QGemm, DequantizeLinear), those of its QuantizeLinear, else the `X_scale` and
    `X_zero_point` constants ONNX Runtime's quantizer names after X (for a tensor only a MaxPool reads, say)."""
    constants = {i.name: i for i in graph.initializer}
    places = _param_places(graph)
    found: dict[str, tuple[float, int]] = {}
    for name in (n for node in graph.node for n in node.output if n.endswith(QUANTIZED_SUFFIX)):
        params = _dequantization(constants, places, name)
        if params is not None:
            found[name] = params
    return found


def _param_places(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """Per tensor a node reads or writes quantized, the names of the scale and zero point that node takes with it."""
    places: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type == "QuantizeLinear":
            places.setdefault(node.output[0], list(node.input[1:3]))
        elif node.op_type in ("DequantizeLinear", "QGemm") or node.op_type.startswith("QLinear"):
            for index, name in enumerate(node.input):
                places.setdefault(name, list(node.input[index + 1:index + 3]))
    return places


def _dequantization(constants: Mapping[str, onnx.TensorProto], places: Mapping[str, list[str]],
                    name: str) -> tuple[float, int] | None:
    """Scale and zero point of the quantized tensor `name`; None unless both are constant scalars."""
    base = name.removesuffix(QUANTIZED_SUFFIX)
    params = places.get(name) or [f"{base}_scale", f"{base}_zero_point"]
    scale = _scalar(constants, params[0]) if params else None
    zero_point = _scalar(constants, params[1]) if len(params) > 1 and params[1] else 0.0
    if scale is not None and zero_point is not None:
        return scale, int(zero_point)
    return None


def _scalar(constants: Mapping[str, onnx.TensorProto], name: str) -> float | None:
    tensor = constants.get(name)
    if tensor is None:
        return None
    array = numpy_helper.to_array(tensor)
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def match(golden: list[LayerTensor], output: list[LayerTensor]) -> list[Pair]:
    """The golden tensors the output graph also has, in the golden's order.

    A golden tensor X pairs with the output graph's X, or ONNX Runtime's rename of it (`InsertedPrecisionFreeCast_X`,
    in an FP16 graph run on a CPU). Where fusion removed X (a Conv's output inside a fused Conv+Relu), the layer is
    compared at the next tensor both graphs still have, whose row names every golden node computed since the
    previous compared tensors (`Pair.nodes`: what `--keep-fp32` would name). An INT8 QOperator graph holds most
    tensors only quantized, as `X_quantized` (uint8): that one is dequantized with the scale and zero point its
    readers take and compared with X or, where ONNX Runtime's quantizer folded a Relu / Clip into X's producer (the
    activation being X's only reader), with the activation's output, which is what it then holds. A quantized tensor
    without a constant scalar scale is not compared.
    """
    partners = _partners(golden, output)
    by_name = {t.name: t for t in golden}
    order = {t.node: index for index, t in enumerate(golden)}
    claimed: set[str] = set()
    pairs = []
    for tensor in golden:
        partner = partners.get(tensor.name)
        if partner is not None:
            nodes = _segment(tensor, by_name, partners.keys(), claimed)
            pairs.append(Pair(tensor, partner, tuple(sorted(nodes, key=order.__getitem__))))
    return pairs


def _partners(golden: list[LayerTensor], output: list[LayerTensor]) -> dict[str, LayerTensor]:
    names = {t.name for t in golden}
    found = {t.name: t for t in output if t.scale is None and t.name in names}
    for tensor in output:
        base = tensor.name.removeprefix(_RENAMED_PREFIX)
        if tensor.scale is None and base != tensor.name and base in names:
            found.setdefault(base, tensor)
    aliases = _quantized_partners(output, names, _consumers(golden), found)
    return {**aliases, **found}  # a tensor holding exactly X wins over one holding X through a folded activation


def _quantized_partners(
    output: list[LayerTensor],
    names: Collection[str],
    consumers: Mapping[str, list[LayerTensor]],
    found: dict[str, LayerTensor],
) -> dict[str, LayerTensor]:
    """Pair each `X_quantized` of the output graph: with X itself (added to `found`), or with the end of the Relu /
    Clip chain folded into X's producer (returned, as aliases)."""
    aliases: dict[str, LayerTensor] = {}
    for tensor in output:
        base = tensor.name.removesuffix(QUANTIZED_SUFFIX)
        if tensor.scale is None or base == tensor.name or base not in names:
            continue
        target = _activation_end(base, consumers)
        if target not in found:
            (aliases if target != base else found).setdefault(target, tensor)
    return aliases


def _consumers(tensors: list[LayerTensor]) -> dict[str, list[LayerTensor]]:
    """Per tensor name, the nodes reading it (each as its first output)."""
    consumers: dict[str, list[LayerTensor]] = {}
    for tensor in tensors:
        for name in dict.fromkeys(tensor.inputs):
            users = consumers.setdefault(name, [])
            if all(u.node != tensor.node for u in users):
                users.append(tensor)
    return consumers


def _activation_end(name: str, consumers: Mapping[str, list[LayerTensor]]) -> str:
    """The tensor a quantized `name` stands for: past the Relu / Clip chain the quantizer folds into its producer."""
    while True:
        users = consumers.get(name, [])
        if len(users) != 1 or users[0].op_type not in _FOLDED_ACTIVATIONS or users[0].inputs[:1] != (name,):
            return name
        name = users[0].name


def _segment(tensor: LayerTensor, by_name: Mapping[str, LayerTensor], compared: Collection[str],
             claimed: set[str]) -> list[str]:
    """The golden nodes that lead to `tensor` from the previous compared tensors, not already named by a row."""
    nodes, stack = [], [tensor]
    while stack:
        current = stack.pop()
        key = current.node or current.name  # an unnamed node is known by its output
        if key in claimed:
            continue
        claimed.add(key)
        if current.node:  # an unnamed one cannot be named to --keep-fp32, but the walk goes on through it
            nodes.append(current.node)
        stack.extend(by_name[n] for n in current.inputs if n in by_name and n not in compared)
    return nodes


@dataclass(slots=True)
class LayerReport:
    """Per matched tensor, the worst comparison over the batches seen."""

    pairs: list[Pair]
    batches: int = 0
    worst: dict[str, Comparison] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)  # tensors whose shapes or types cannot be compared

    def add_batch(self, golden: Mapping[str, np.ndarray], output: Mapping[str, np.ndarray]) -> None:
        self.batches += 1
        for pair in self.pairs:
            name = pair.golden.name
            expected, got = golden.get(name), output.get(pair.output.name)
            if expected is None or got is None or not (_numeric(expected) and _numeric(got)):
                continue
            try:
                result = compare(expected, pair.output.value(got))
            except CompilerError:
                self.skipped.add(name)
                continue
            previous = self.worst.get(name)
            self.worst[name] = result if previous is None else _worse(previous, result)

    @property
    def rows(self) -> list[Row]:
        return [Row(p, self.worst[p.golden.name]) for p in self.pairs if p.golden.name in self.worst]

    def first_over(self, threshold: float) -> int | None:
        """The index in `rows` of the first layer (graph inputs aside) whose max rel error is above `threshold`."""
        over = (i for i, r in enumerate(self.rows) if r.pair.golden.kind != "input" and not r.result.within(threshold))
        return next(over, None)

    def lines(self, threshold: float) -> list[str]:
        rows, first = self.rows, self.first_over(threshold)
        lines = [f"layers: {len(rows)} tensors compared by name over {self.batches} batch(es) (the worst batch of "
                 f"each); threshold: max rel error {threshold:g}"]
        if self.skipped:
            lines.append(f"layers: not compared (shapes differ): {', '.join(sorted(self.skipped))}")
        lines += [_row_line(i + 1, row, threshold if i == first else None) for i, row in enumerate(rows)]
        if first is None:
            return [*lines, f"layers: no layer above max rel error {threshold:g}"]
        row = rows[first]
        nodes = ",".join(row.pair.nodes)
        prefix = sum(len(r.pair.nodes) for r in rows[:first + 1])
        return [*lines, f"layers: first above max rel error {threshold:g}: layer {first + 1} '{row.pair.golden.name}' "
                         f"of node(s) {nodes} (to keep them in FP32: --keep-fp32 {nodes}); errors compound, so where "
                         f"that is not enough keep layers 1-{first + 1} ({prefix} nodes: the 'nodes' column of those "
                         f"--layers-csv rows, one per line in a file given as --keep-fp32 @FILE)"]

    def write_csv(self, path: Path, threshold: float) -> None:
        """The rows of `lines`; `nodes` lists the golden nodes each covers (`;`-separated), `first_over` marks one."""
        first = self.first_over(threshold)
        try:
            with open(path, "w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(["index", "kind", "node", "op_type", "tensor", "nodes", "cosine", "max_abs", "max_rel",
                                 "over_threshold", "first_over"])
                for index, row in enumerate(self.rows):
                    golden, result = row.pair.golden, row.result
                    writer.writerow([index + 1, golden.kind, golden.node, golden.op_type, golden.name,
                                     ";".join(row.pair.nodes), f"{result.cosine:.9g}", f"{result.max_abs:.9g}",
                                     f"{result.max_rel:.9g}", int(not result.within(threshold)), int(index == first)])
        except OSError as exc:
            raise CompilerError(f"cannot write {path}: {exc.strerror or exc}") from None


def _row_line(index: int, row: Row, first_over: float | None) -> str:
    golden, result = row.pair.golden, row.result
    if golden.kind != "output":  # top-1 agreement means something for a classifier's output only
        result = replace(result, top1=None)
    node = golden.node or ("(input)" if golden.kind == "input" else "(unnamed)")
    text = f"layer {index:>3} {node} [{golden.op_type or golden.kind}] " \
           + result.describe(repr(golden.name))
    return text if first_over is None else f"{text}  <-- first above {first_over:g}"


def _numeric(array: np.ndarray) -> bool:
    return bool(np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_)


def _worse(a: Comparison, b: Comparison) -> Comparison:
    """The worse of two batches' comparisons of one tensor (NaN stays NaN)."""
    top1 = None
    if a.top1 is not None and b.top1 is not None:
        top1 = (a.top1 * a.rows + b.top1 * b.rows) / (a.rows + b.rows)
    return Comparison(float(np.minimum(a.cosine, b.cosine)), float(np.maximum(a.max_abs, b.max_abs)),
                      float(np.maximum(a.max_rel, b.max_rel)), top1, a.rows + b.rows)


def expose(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` whose graph outputs also hold `names` (intermediate tensors), after its own outputs."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output}
    # A graph output with a name only: ONNX Runtime infers its type from the producing node.
    exposed.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in present)
    return exposed
