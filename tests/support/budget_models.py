"""Models for the memory budget's tests and benchmark: many MLPs of a chosen weight size, each with its own seeded
weights so that every answer can be checked against numpy, and a slow Python model to hold a request in flight."""

from __future__ import annotations

import threading
import time
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
# A Python model's config: FP32 [batch, 1] `IN` to `OUT` (tests/support/models.slow_python's model among others).
PYTHON_CONFIG = """
backend: "python"
max_batch_size: 4
input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]
output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


def tree_pss(root: int) -> int:
    """Bytes of PSS of process `root` and all its descendants (a page they share counts once): what the server costs
    the machine. Read from /proc, not with geserve's own measure, which the tests check."""
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{pid}/task").iterdir():  # a child's parent is the thread that started it
                pending.extend(int(child) for child in (task / "children").read_text().split())
        except OSError:  # gone meanwhile
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


class PeakPss:
    """The highest `tree_pss(root)` seen, sampled every `interval_s` on a thread until `stop`."""

    def __init__(self, root: int, interval_s: float = 0.05) -> None:
        self.peak = 0
        self._root, self._interval = root, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss(self._root))
            time.sleep(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
