"""Small ONNX step models and ensemble configs for the ensemble tests (geserve's and the real Triton's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.support import models

Io = tuple[str, str, Sequence[int]]  # name, config data type ("TYPE_FP32"), dims


@dataclass(frozen=True)
class Step:
    model: str
    inputs: dict[str, str]  # model input -> ensemble tensor
    outputs: dict[str, str]  # model output -> ensemble tensor
    version: int = -1


@dataclass(frozen=True)
class Ensemble:
    name: str
    inputs: Sequence[Io]
    outputs: Sequence[Io]
    steps: Sequence[Step]
    max_batch_size: int = 8
    extra: str = ""
    optional: Sequence[str] = field(default_factory=tuple)

    def config(self) -> str:
        def io(entries: Sequence[Io]) -> str:
            return ", ".join(
                f'{{ name: "{n}" data_type: {t} dims: [ {", ".join(str(d) for d in dims)} ]'
                + (" optional: true" if n in self.optional else "")
                + " }"
                for n, t, dims in entries
            )

        def step(s: Step) -> str:
            maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in s.inputs.items())
            maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in s.outputs.items())
            return f'  {{ model_name: "{s.model}" model_version: {s.version}{maps} }}'

        steps = ",\n".join(step(s) for s in self.steps)
        return (
            f'name: "{self.name}"\nplatform: "ensemble"\nmax_batch_size: {self.max_batch_size}\n'
            f"input [ {io(self.inputs)} ]\noutput [ {io(self.outputs)} ]\n"
            f"ensemble_scheduling {{ step [\n{steps}\n] }}\n{self.extra}"
        )

    def write(self, repo: Path) -> Path:
        """The config and an empty version folder, as Triton wants an ensemble laid out."""
        model_dir = repo / self.name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "config.pbtxt").write_text(self.config())
        return model_dir


def _save(repo: Path, name: str, graph: onnx.GraphProto, config: str) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(model_dir / "1" / "model.onnx"))
    (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def add_sub(repo: Path, name: str = "add_sub", max_batch_size: int = 8, extra: str = "") -> Path:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, INT32 [16] (Triton's `simple`)."""
    return models.simple(repo, name, max_batch_size, extra)


def identity_int32(repo: Path, name: str = "identity_int32") -> Path:
    """OUTPUT0 = INPUT0, INT32 [-1], batching."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.INT32, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, ["batch", "n"])],
    )
    config = f"""name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] }} ]
"""
    return _save(repo, name, graph, config)


def affine(repo: Path, name: str, scale: float, shift: float, heavy: int = 0, size: int = 384) -> Path:
    """Y = X * scale + shift, FP32 [4], batching. `heavy` > 0 adds that many [size, size] MatMul+Tanh rounds
    seeded from X whose result is multiplied by zero: the answer stays exact, the run takes real CPU time
    (ONNX Runtime cannot fold it away, it depends on the input). One intra-op thread, so two run in parallel."""
    nodes = [
        helper.make_node("Mul", ["X", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "shift"], ["Y0"] if heavy else ["Y"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array(scale, np.float32), "scale"),
        numpy_helper.from_array(np.array(shift, np.float32), "shift"),
    ]
    if heavy:
        rng = np.random.default_rng(0)
        initializers += [
            numpy_helper.from_array((rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32), "W"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ]
        nodes.append(helper.make_node("ReduceSum", ["X"], ["seed"], keepdims=0))
        nodes.append(helper.make_node("Add", ["W", "seed"], ["M0"]))
        for k in range(heavy):
            nodes.append(helper.make_node("MatMul", [f"M{k}", "W"], [f"P{k}"]))
            nodes.append(helper.make_node("Tanh", [f"P{k}"], [f"M{k + 1}"]))
        nodes.append(helper.make_node("ReduceSum", [f"M{heavy}"], ["total"], keepdims=0))
        nodes.append(helper.make_node("Mul", ["total", "zero"], ["nothing"]))
        nodes.append(helper.make_node("Add", ["Y0", "nothing"], ["Y"]))
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        initializer=initializers,
    )
    config = f"""name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
"""
    return _save(repo, name, graph, config)


def add(repo: Path, name: str = "add") -> Path:
    """SUM = A + B, FP32 [4], batching: the step that joins two branches."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["SUM"])],
        name,
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("B", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("SUM", TensorProto.FLOAT, ["batch", 4])],
    )
    config = f"""name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "A" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "B" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""
    return _save(repo, name, graph, config)


INT16 = ("TYPE_INT32", (16,))
AB = [("A", *INT16), ("B", *INT16)]


def add_sub_step(model: str, a: str, b: str, total: str, difference: str) -> Step:
    return Step(model, {"INPUT0": a, "INPUT1": b}, {"OUTPUT0": total, "OUTPUT1": difference})


def chain(name: str, model: str, max_batch_size: int = 8) -> Ensemble:
    """(A, B) -> model -> (s, d) -> model -> (SUM = s + d = 2A, DIFF = s - d = 2B)."""
    return Ensemble(
        name, AB, [("SUM", *INT16), ("DIFF", *INT16)],
        [add_sub_step(model, "A", "B", "s", "d"), add_sub_step(model, "s", "d", "SUM", "DIFF")],
        max_batch_size,
    )


def repeat_inc(name: str = "repeat_inc") -> Ensemble:
    """IN -> repeat (decoupled: one response per element) -> o -> inc -> Y = o + 1; IDX straight from repeat."""
    return Ensemble(
        name, [("IN", "TYPE_INT32", (-1,))], [("Y", "TYPE_INT32", (1,)), ("IDX", "TYPE_UINT32", (1,))],
        [Step("repeat", {"IN": "IN"}, {"OUT": "o", "IDX": "IDX"}), Step("inc", {"X": "o"}, {"Y": "Y"})],
        max_batch_size=0,
    )
