"""Models for the memory budget's tests and benchmark: many MLPs of a chosen weight size, each with its own seeded
weights so that every answer can be checked against numpy, and a slow Python model to hold a request in flight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WIDTH = 256  # input features
OUTPUTS = 4


def weights(seed: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((WIDTH, hidden)) / np.sqrt(WIDTH)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, OUTPUTS)) / np.sqrt(hidden)).astype(np.float32)
    return w1, w2


def expected(seed: int, hidden: int, x: np.ndarray) -> np.ndarray:
    """What model `seed` answers for `x` ([batch, WIDTH] FP32): relu(x @ W1) @ W2."""
    w1, w2 = weights(seed, hidden)
    return np.maximum(x @ w1, 0) @ w2


def mlp(repo: Path, name: str, seed: int, hidden: int, extra: str = "") -> Path:
    """`name`: FP32 [batch, WIDTH] -> `OUT` [batch, OUTPUTS], weights of about WIDTH x hidden x 4 bytes; `extra` ends
    its config.pbtxt."""
    w1, w2 = weights(seed, hidden)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["IN", "W1"], ["H"]),
            helper.make_node("Relu", ["H"], ["R"]),
            helper.make_node("MatMul", ["R", "W2"], ["OUT"]),
        ],
        name,
        [helper.make_tensor_value_info("IN", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, ["batch", OUTPUTS])],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    (folder / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        f'input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
        f'output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ {OUTPUTS} ] }} ]\n'
        f"instance_group [ {{ count: 1 kind: KIND_CPU }} ]\n{extra}\n"
    )
    return folder


PINNED = 'parameters { key: "pinned" value: { string_value: "true" } }'


def tree_pss(root: int) -> int:
    """Bytes of PSS of process `root` and all its descendants (a page they share counts once): what the server costs
    the machine."""
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            pending += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def samples(exposition: str, family: str) -> dict[str, float]:
    """The samples of one metric family in Prometheus text, by their label text (`model="m1",version="1"`)."""
    found: dict[str, float] = {}
    for line in exposition.splitlines():
        if line.startswith(family + "{") or line.startswith(family + " "):
            key, _, value = line.rpartition(" ")
            found[key[len(family) :].strip("{}")] = float(value)
    return found


def zipf(count: int, exponent: float) -> np.ndarray:
    """Popularity of `count` models ranked 1..count: p(k) proportional to k^-exponent."""
    weights = np.arange(1, count + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()
