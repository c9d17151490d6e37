"""compile_model: runs the front end and the passes in order and returns the manifest and the ONNX bytes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import onnx

from geserve.cachekeys import file_hash
from geserve.compiler.custom_ops import custom_domains, library_names, session_options
from geserve.compiler.errors import CompilerError
from geserve.compiler.frontends import detect_framework, load_model
from geserve.compiler.keep import check_keep_fp32
from geserve.compiler.optimize import TARGET_LEVEL, optimize
from geserve.compiler.options import CompileOptions
from geserve.compiler.package import Manifest
from geserve.compiler.precision import apply_precision
from geserve.compiler.preprocess import insert_preprocessing, load_config
from geserve.compiler.shapes import cut_outputs, drop_identities, fix_input_shapes, graph_inputs, signature
from geserve.version import __version__

logger = logging.getLogger(__name__)
COMPILER_VERSION = f"geserve-compiler {__version__}"


def source_hash(options: CompileOptions) -> str:
    path = options.model
    if path.is_dir():
        from geserve.compiler.options import _tree_hash

        return _tree_hash(path)
    if not path.is_file():
        raise CompilerError(f"model {path} not found")
    return file_hash(path)


def compile_model(
    options: CompileOptions, progress: Callable[[str], None] | None = None
) -> tuple[Manifest, bytes]:
    report = progress or (lambda message: logger.info("%s", message))
    framework = options.framework or detect_framework(options.model)
    started = time.perf_counter()
    report(f"reading {options.model} ({framework})")
    model = load_model(options.model, framework, options.input_shapes, options.out_nodes, options.signature)
    source_nodes = len(model.graph.node)
    model = _shape_source(model, options, framework, report)
    model, before_optimization, after_optimization = _convert(model, options, report)
    onnx_bytes = model.SerializeToString()
    counts = {"source": source_nodes, "before_optimization": before_optimization,
              "after_optimization": after_optimization, "compiled": len(model.graph.node)}
    manifest = _manifest(options, framework, model, counts)
    report(
        f"compiled in {time.perf_counter() - started:.1f} s: {source_nodes} -> {len(model.graph.node)} nodes, "
        f"{len(onnx_bytes) / 1e6:.1f} MB"
    )
    return manifest, onnx_bytes


def _shape_source(
    model: onnx.ModelProto, options: CompileOptions, framework: str, report: Callable[[str], None]
) -> onnx.ModelProto:
    """The passes before any optimization: --keep-fp32 checked, --out-nodes cut, --input-shape fixed, and the
    --insert-op-conf preprocessing folded in."""
    check_keep_fp32(model, options.keep_fp32)
    if framework != "onnx" or options.out_nodes:
        model = cut_outputs(model, options.out_nodes if framework == "onnx" else [])
    model = fix_input_shapes(model, options.input_shapes, options.batch_gears)
    if options.insert_op_conf:
        report(f"folding preprocessing from {options.insert_op_conf}")
        model = insert_preprocessing(model, load_config(options.insert_op_conf))
    return model


def _convert(
    model: onnx.ModelProto, options: CompileOptions, report: Callable[[str], None]
) -> tuple[onnx.ModelProto, int, int]:
    """Optimize, quantize and convert the precision; also the node counts before and after the optimization."""
    final_level = TARGET_LEVEL[options.target] if options.optimize else None
    converts = options.quantize != "none" or options.precision_mode not in ("force_fp32", "must_keep_origin_dtype")
    check_custom_ops(model, options, converts)
    model = drop_identities(model)
    # Node counts around the optimization of the FP32 graph (before an FP16 / INT8 conversion adds Cast or Q/DQ
    # nodes, and ONNX Runtime its own Casts around ops without FP16 kernels): what constant folding and fusion did.
    before_optimization = len(model.graph.node)
    if options.optimize and converts:
        report("optimizing (constant folding, Conv+BN fusion)")
        model = optimize(model, "basic", options.custom_op_libraries)
    after_optimization = len(model.graph.node)
    model = _quantize_and_convert(model, options, report)
    if final_level and not (converts and final_level == "basic"):
        report(f"optimizing for {options.target} ({final_level} fusions)")
        model = optimize(model, final_level, options.custom_op_libraries)
        after_optimization = after_optimization if converts else len(model.graph.node)
    return model, before_optimization, after_optimization


def _quantize_and_convert(
    model: onnx.ModelProto, options: CompileOptions, report: Callable[[str], None]
) -> onnx.ModelProto:
    if options.quantize == "int8":
        if options.calibration_data is None:
            raise CompilerError("--quantize int8 needs --calibration-data DIR (.npy / .npz files)")
        report(f"calibrating and quantizing to INT8 with {options.calibration_data}")
        model = quantize_step(model, options)
    return apply_precision(model, options.precision_mode, options.keep_io_types, options.custom_op_libraries,
                           options.keep_fp32)


def _manifest(options: CompileOptions, framework: str, model: onnx.ModelProto, counts: dict[str, int]) -> Manifest:
    return Manifest(
        source_hash=source_hash(options),
        compiler_version=COMPILER_VERSION,
        inputs=signature(graph_inputs(model)),
        outputs=signature(model.graph.output),
        batch_gears=list(options.batch_gears),
        precision=options.precision_mode,
        quantization=options.quantize,
        target=options.target,
        framework=framework,
        options={k: v for k, v in options.cache_fields().items() if v not in (None, [], {}, "")},
        node_counts=counts,
        custom_op_libraries=library_names(options.custom_op_libraries),
        custom_op_domains=custom_domains(model),
    )


def check_custom_ops(model: onnx.ModelProto, options: CompileOptions, converts: bool) -> None:
    """The custom-op libraries load, and a graph with custom ops that ONNX Runtime must open has them."""
    session_options(options.custom_op_libraries)
    domains = ", ".join(custom_domains(model))
    if domains and options.quantize == "int8":
        # ONNX Runtime's calibrator (quantize_static -> create_calibrator) makes its own InferenceSession from fresh
        # SessionOptions and takes no custom-op library, so it cannot run this graph; rebuilding quantize_static
        # from its internals to pass one would break with each ONNX Runtime release.
        raise CompilerError(f"--quantize int8 cannot calibrate a graph with custom operators (domain {domains}): "
                            f"ONNX Runtime's calibrator cannot load custom-op libraries; compile it in FP32 or FP16")
    if domains and not options.custom_op_libraries and (options.optimize or converts):
        raise CompilerError(f"the graph uses custom operators (domain {domains}): give their library with "
                            f"--custom-op-library PATH (a served model: its 'custom_ops' parameter)")


def quantize_step(model: onnx.ModelProto, options: CompileOptions) -> onnx.ModelProto:
    from geserve.compiler.quantize import quantize_int8

    assert options.calibration_data is not None
    return quantize_int8(model, options.calibration_data, options.target, options.per_channel, options.keep_fp32)
