"""Builds the `digits` example: an MLP trained on scikit-learn's bundled digits, converted with skl2onnx.

Idempotent: a stamp of this script's hash skips the rebuild. The held-out split is saved for accuracy tests.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
LABELS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CONFIG = """\
name: "digits"
platform: "graph_executor"
max_batch_size: 64
input [
  { name: "pixels", data_type: TYPE_FP32, dims: [ 64 ] }
]
output [
  { name: "probabilities", data_type: TYPE_FP32, dims: [ 10 ], label_filename: "labels.txt" },
  { name: "label", data_type: TYPE_INT64, dims: [ 1 ], reshape: { shape: [ ] } }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "EXECUTOR_TYPE", value: { string_value: "GE" } }
"""


def build(repository: Path, data_dir: Path) -> Path:
    model_dir = repository / "digits"
    stamp = model_dir / ".stamp"
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    if stamp.is_file() and stamp.read_text() == digest and (data_dir / "digits_test.npz").is_file():
        return model_dir

    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    features, targets = load_digits(return_X_y=True)
    features = features.astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        features, targets, test_size=0.25, random_state=0, stratify=targets
    )
    classifier = make_pipeline(
        StandardScaler(), MLPClassifier(hidden_layer_sizes=(128,), max_iter=600, random_state=0)
    )
    classifier.fit(x_train, y_train)
    onnx_model = to_onnx(
        classifier,
        initial_types=None,
        X=x_train[:1],
        options={id(classifier.steps[-1][1]): {"zipmap": False}},
        target_opset=17,
        final_types=None,
    )
    graph = onnx_model.graph
    graph.input[0].name = "pixels"
    for node in graph.node:
        node.input[:] = ["pixels" if name == "X" else name for name in node.input]
    for output in graph.output:
        if output.name == "output_label":
            output.name = "label"
        elif output.name == "output_probability":
            output.name = "probabilities"
    renames = {"output_label": "label", "output_probability": "probabilities"}
    for node in graph.node:
        node.output[:] = [renames.get(name, name) for name in node.output]
    for dim in (graph.input[0].type.tensor_type.shape.dim[0], *(o.type.tensor_type.shape.dim[0] for o in graph.output)):
        dim.Clear()
        dim.dim_param = "batch"

    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.onnx").write_bytes(onnx_model.SerializeToString())
    (model_dir / "config.pbtxt").write_text(CONFIG)
    (model_dir / "labels.txt").write_text("\n".join(LABELS) + "\n")
    data_dir.mkdir(parents=True, exist_ok=True)
    np.savez(data_dir / "digits_test.npz", pixels=x_test, labels=y_test)
    accuracy = classifier.score(x_test, y_test)
    print(f"digits: trained MLP, held-out accuracy {accuracy:.3f} on {len(y_test)} images")
    stamp.write_text(digest)
    return model_dir
