"""`geserve compile --check --layers`: the source and the compiled graph run on the same inputs with their tensors
exposed as outputs, compared layer by layer (layers.py), and with `--dump-dir` dumped as `geserve compare` reads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from geserve.compiler.custom_ops import session_options
from geserve.compiler.dumps import batch_name, write_batch
from geserve.compiler.errors import CompilerError
from geserve.compiler.frontends import detect_framework, load_model
from geserve.compiler.layers import LayerReport, LayerTensor, describe, expose, match
from geserve.compiler.options import CompileOptions

_Side = tuple[str, list[LayerTensor], ort.InferenceSession]  # "golden" or "compiled", its tensors, its session


def check_layers(
    source: onnx.ModelProto,
    compiled: onnx.ModelProto,
    batches: Sequence[dict[str, np.ndarray]],
    dump_dir: Path | None = None,
    custom_op_libraries: Sequence[Path] = (),
) -> LayerReport:
    """Compare every tensor both graphs compute; with `dump_dir`, every tensor of both is also written there, under
    `golden/batch_NNNNNN/` and `compiled/batch_NNNNNN/`."""
    golden, output = describe(source), describe(compiled)
    report = LayerReport(match(golden, output))
    # Without a dump, only the compared tensors are exposed: each one exposed stays allocated for the whole run.
    wanted = [{p.golden.name for p in report.pairs}, {p.output.name for p in report.pairs}]
    sides = [
        (side, tensors, _session(expose(model, _exposed(tensors, names, dump_dir)), custom_op_libraries))
        for (model, tensors, names), side in zip(((source, golden, wanted[0]), (compiled, output, wanted[1])),
                                                 ("golden", "compiled"), strict=True)
    ]
    for number, feed in enumerate(batches, 1):
        values = [_run(session, feed) for _, _, session in sides]
        if dump_dir is not None:
            _dump_batch(dump_dir, number, sides, feed, values)
        report.add_batch(*values)
    return report


def _exposed(tensors: list[LayerTensor], names: set[str], dump_dir: Path | None) -> list[str]:
    """The layer tensors to expose as outputs: all of them for a dump, else those compared."""
    return [t.name for t in tensors if t.kind == "layer" and (dump_dir is not None or t.name in names)]


def _dump_batch(dump_dir: Path, number: int, sides: list[_Side], feed: dict[str, np.ndarray],
                values: list[dict[str, np.ndarray]]) -> None:
    for (side, tensors, _), computed in zip(sides, values, strict=True):
        _dump(dump_dir / side / batch_name(number), tensors, {**feed, **computed})


def _session(model: onnx.ModelProto, libraries: Sequence[Path]) -> ort.InferenceSession:
    options = session_options(libraries)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no fusion renames a tensor
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise CompilerError(f"--layers: ONNX Runtime cannot run the graph with its tensors exposed: "
                            f"{(str(exc).splitlines() or [type(exc).__name__])[0]}") from None


def _run(session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return {n: v for n, v in zip(names, session.run(names, feed), strict=True) if isinstance(v, np.ndarray)}


def _dump(folder: Path, tensors: list[LayerTensor], values: dict[str, np.ndarray]) -> None:
    try:
        write_batch(folder, tensors, values)
    except OSError as exc:
        raise CompilerError(f"--dump-dir: cannot write {folder}: {exc.strerror or exc}") from None


def run_layers(
    options: CompileOptions,
    onnx_bytes: bytes,
    feeds: Sequence[dict[str, np.ndarray]],
    threshold: float,
    csv_path: Path | None = None,
    dump_dir: Path | None = None,
) -> list[str]:
    """The `--layers` report lines of a compile, the source read again through its front end."""
    framework = options.framework or detect_framework(options.model)
    source = load_model(options.model, framework, options.input_shapes, options.out_nodes, options.signature)
    report = check_layers(source, onnx.load_from_string(onnx_bytes), feeds, dump_dir, options.custom_op_libraries)
    if csv_path is not None:
        report.write_csv(csv_path, threshold)
    return report.lines(threshold)
