"""Child process of the TensorFlow front end: converts one SavedModel, frozen GraphDef or Keras file with tf2onnx.

Run as `python -m geserve.compiler.tf_convert REQUEST.json`, never imported by the server: TensorFlow's import costs
seconds, hundreds of MB and its own thread pools, none of which a serving process should keep after a compile. It
drives tf2onnx's documented command line (`tf2onnx.convert.main`, what `python -m tf2onnx.convert` runs), because
tf2onnx's Python API has no SavedModel entry point. An error is one line `geserve-tf: <message>` on stderr, exit 1.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

ERROR_PREFIX = "geserve-tf: "
# ONNX Runtime 1.17 (the oldest geserve accepts) runs ONNX opsets up to 20; tf2onnx caps at its own highest.
ORT_MAX_OPSET = 20
_UNSUPPORTED = re.compile(r"Tensorflow op \[(?P<node>[^\]]+): (?P<op>[^\]]+)\] is not supported")
_INTERNAL_SIGNATURES = ("__saved_model_init_op",)


class ConversionError(Exception):
    """A one-line message for the user; the parent turns it into a CompilerError."""


class _UnsupportedOps(logging.Handler):
    """Collects tf2onnx's "Tensorflow op [node: Op] is not supported" reports, in order."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _UNSUPPORTED.search(record.getMessage())
        if match:
            self.found.append((match["op"], match["node"]))


def choose_signature(saved_model: Path, wanted: str) -> str:
    """`wanted`, else `serving_default` (what TensorFlow Serving and Triton use), else the only one there is."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((saved_model / "saved_model.pb").read_bytes())
    names = sorted({name for graph in proto.meta_graphs for name in graph.signature_def} - set(_INTERNAL_SIGNATURES))
    if wanted and wanted not in names:
        raise ConversionError(f"SavedModel {saved_model} has no signature '{wanted}'; it has: {', '.join(names)}")
    if wanted:
        return wanted
    if "serving_default" in names or not names:
        return "serving_default"
    if len(names) == 1:
        return names[0]
    raise ConversionError(
        f"SavedModel {saved_model} has no 'serving_default' signature and several others "
        f"({', '.join(names)}); choose one with --signature"
    )


def keras_io_names(path: Path) -> tuple[list[str], list[str]]:
    """A functional Keras model's input and output layer names, read from the `.keras` archive's config.json
    (tf2onnx names them after graph tensors such as `Identity:0`); empty lists where the file does not say."""
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json")).get("config", {})
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return [], []
    return _layer_names(config.get("input_layers")), _layer_names(config.get("output_layers"))


def _layer_names(layers: Any) -> list[str]:
    if not isinstance(layers, list) or not layers:
        return []
    if isinstance(layers[0], str):  # a single tensor is written as one [name, node, index] triple
        layers = [layers]
    return [str(layer[0]) for layer in layers if isinstance(layer, list) and layer]


def _tensor(name: str) -> str:
    return name if re.search(r":\d+$", name) else f"{name}:0"


def _plain(name: str) -> str:
    return re.sub(r":\d+$", "", name)


def tf2onnx_arguments(request: dict[str, Any], opset: int) -> list[str]:
    """tf2onnx's command line for one conversion request (see geserve/compiler/tensorflow.py for its fields)."""
    path = Path(request["model"])
    arguments = ["--opset", str(opset), "--output", request["output"]]
    kind = request["kind"]
    if kind == "saved_model":
        return [*arguments, "--saved-model", str(path), "--signature_def", choose_signature(path, request["signature"])]
    if kind == "keras":
        return [*arguments, *_keras_arguments(path)]
    return [*arguments, *_graphdef_arguments(path, request)]


def _keras_arguments(path: Path) -> list[str]:
    arguments = ["--keras", str(path)]
    layer_inputs, layer_outputs = keras_io_names(path)
    # tf2onnx names a Keras model's tensors after its graph (image:0, Identity:0): the layer names are the
    # model's own, so they become the ONNX names when the file gives them.
    if layer_inputs:
        arguments += ["--rename-inputs", ",".join(layer_inputs)]
    if layer_outputs:
        arguments += ["--rename-outputs", ",".join(layer_outputs)]
    return arguments


def _graphdef_arguments(path: Path, request: dict[str, Any]) -> list[str]:
    inputs, outputs = request["inputs"], request["outputs"]
    if not inputs or not outputs:
        raise ConversionError("a frozen TensorFlow GraphDef needs --input-shape (its inputs) and --out-nodes")
    shapes = request["input_shapes"]
    named = [_tensor(n) + (f"[{','.join(str(d) for d in shapes[n])}]" if shapes.get(n) else "") for n in inputs]
    return [
        "--graphdef", str(path), "--inputs", ",".join(named),
        "--outputs", ",".join(_tensor(n) for n in outputs),
        # Triton's GraphDef models name their tensors as atc does, after the node (`image`, not `image:0`).
        "--rename-inputs", ",".join(_plain(n) for n in inputs),
        "--rename-outputs", ",".join(_plain(n) for n in outputs),
    ]


def highest_opset() -> int:
    import onnx
    from tf2onnx import constants

    return min(max(constants.OPSET_TO_IR_VERSION), onnx.defs.onnx_opset_version(), ORT_MAX_OPSET)


def unknown_ops(output: Path) -> list[tuple[str, str]]:
    """(op, node) of every node no ONNX schema defines: what tf2onnx left as a TensorFlow op."""
    import onnx

    model = onnx.load(str(output), load_external_data=False)
    return [(node.op_type, node.name) for node in model.graph.node
            if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type)]


def convert(request: dict[str, Any]) -> None:
    try:
        import tensorflow  # noqa: F401 - tf2onnx needs it; its absence is the user's to fix
        from tf2onnx import convert as tf2onnx_convert
    except ImportError as exc:
        raise ConversionError(f"the TensorFlow front end needs tensorflow and tf2onnx ({exc}): "
                              f"pip install 'geserve[tensorflow]'") from None
    arguments = tf2onnx_arguments(request, highest_opset())
    collector = _UnsupportedOps()
    logging.getLogger("tf2onnx").addHandler(collector)
    sys.argv = ["tf2onnx.convert", *arguments]
    try:
        tf2onnx_convert.main()
    except Exception as exc:
        if not collector.found:
            text = str(exc).strip().splitlines()
            raise ConversionError(f"tf2onnx failed: {text[0] if text else type(exc).__name__}") from None
    found = list(dict.fromkeys(collector.found or unknown_ops(Path(request["output"]))))
    if found:
        listed = ", ".join(f"{op} (node {node})" for op, node in found)
        raise ConversionError(f"unsupported TensorFlow op{'s' if len(found) > 1 else ''} {listed}: ONNX has no "
                              f"equivalent that tf2onnx knows; change the model or cut it before that op")


def main(argv: list[str]) -> int:
    try:
        convert(json.loads(Path(argv[0]).read_text()))
    except ConversionError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
