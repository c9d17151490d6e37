"""Helpers shared by the example builders: the source-hash stamp that makes a build idempotent, and ONNX export."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

STAMP = ".stamp"


def source_digest(*sources: str | Path) -> str:
    """Hash of the builder's own source (and of this file), written to the model's stamp."""
    digest = hashlib.sha256()
    for source in (*sources, __file__):
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()


def is_built(model_dir: Path, digest: str) -> bool:
    stamp = model_dir / STAMP
    return stamp.is_file() and stamp.read_text() == digest and (model_dir / "1" / "model.onnx").is_file()


def write_model(model_dir: Path, config: str, digest: str, files: dict[str, str] | None = None) -> None:
    """Writes config.pbtxt and extra text files; the stamp goes last, once model.onnx is in place."""
    (model_dir / "config.pbtxt").write_text(config)
    for name, text in (files or {}).items():
        (model_dir / name).write_text(text)
    (model_dir / STAMP).write_text(digest)


def export_onnx(
    module: Any,
    args: tuple[Any, ...],
    path: Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_axes: dict[str, dict[int, str]],
) -> None:
    """torch.onnx.export (opset 17, TorchScript exporter: needs no onnxscript), then constant folding.

    The exporter leaves constant subgraphs (e.g. the pad amounts of F.pad); ONNX Runtime's basic level folds them
    and drops no-ops, and writes plain ONNX operators only, so the file stays portable to any runtime.
    """
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "Constant folding", UserWarning)
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
            opset_version=17,
            do_constant_folding=True,
            dynamo=False,
        )
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(path)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    import onnx

    model = onnx.load(str(path))
    used = {node.domain for node in model.graph.node} | {""}
    assert used == {""}, f"non-standard operator domains in {path}: {used}"
    kept = [opset for opset in model.opset_import if opset.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def run_onnx(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)
