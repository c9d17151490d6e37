"""`geserve compile`: runs a compile (or prints a package's manifest) and turns errors into one line + exit code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from geserve.compiler.errors import CompilerError
from geserve.compiler.keep import parse_keep_fp32
from geserve.compiler.options import CompileOptions, parse_bool, parse_input_shapes, parse_int_list
from geserve.compiler.package import Manifest, load_key, read_manifest, write_package

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def format_manifest(path: Path) -> str:
    manifest = read_manifest(path)
    data = manifest.to_dict()
    lines = [f"compiled model {path} ({path.stat().st_size / 1e6:.1f} MB)"]
    for key in ("format_version", "compiler_version", "source_hash", "framework", "target", "precision",
                "quantization", "batch_gears", "encrypted"):
        lines.append(f"  {key:<17} {data[key]}")
    for kind in ("inputs", "outputs"):
        for name, tensor in data[kind].items():
            lines.append(f"  {kind[:-1]:<17} {name}: {tensor['dtype']} {tensor['shape']}")
    counts = data["node_counts"]
    lines.append(f"  {'nodes':<17} {counts.get('source', '?')} in the source, {counts.get('compiled', '?')} compiled")
    if "before_optimization" in counts:
        lines.append(f"  {'optimization':<17} {counts['before_optimization']} -> {counts['after_optimization']} nodes")
    if manifest.custom_op_domains or manifest.custom_op_libraries:
        libraries = ", ".join(manifest.custom_op_libraries) or "no library recorded"
        lines.append(f"  {'custom ops':<17} {', '.join(manifest.custom_op_domains) or '-'} ({libraries})")
    lines.append(f"  {'options':<17} {json.dumps(data['options'], sort_keys=True)}")
    return "\n".join(lines)


def options_from_args(args: argparse.Namespace) -> CompileOptions:
    return CompileOptions(
        model=args.model,
        framework=args.framework or "",
        input_shapes=parse_input_shapes(args.input_shape or ""),
        batch_gears=parse_int_list(args.dynamic_batch_size or "", "--dynamic-batch-size"),
        out_nodes=[n.strip() for n in (args.out_nodes or "").replace(";", ",").split(",") if n.strip()],
        signature=args.signature or "",
        precision_mode=args.precision_mode,
        keep_io_types=parse_bool(args.keep_io_types, "--keep-io-types"),
        keep_fp32=parse_keep_fp32(args.keep_fp32 or ""),
        quantize=args.quantize,
        calibration_data=args.calibration_data,
        insert_op_conf=args.insert_op_conf,
        target=args.target,
        optimize=not args.no_optimize,
        custom_op_libraries=args.custom_op_library or [],
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.info:
            print(format_manifest(args.model))
            return EXIT_OK
        if args.output is None:
            print("error: geserve compile needs --output OUT.gem (or --info)", file=sys.stderr)
            return EXIT_USAGE
        compile_and_report(args)
        return EXIT_OK
    except CompilerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def compile_and_report(args: argparse.Namespace) -> None:
    """Compile, write the package, print what was written, then the checks and the TensorRT cache it asks for."""
    from geserve.compiler.pipeline import compile_model

    options = options_from_args(args)
    _check_flags(args, options)
    key = load_key(args.encrypt_key_file, env="") if args.encrypt_key_file else None
    quiet = args.quiet or not sys.stderr.isatty()
    manifest, onnx_bytes = compile_model(options, None if quiet else _progress)
    path = write_package(args.output, manifest, onnx_bytes, key)
    _report_written(path, manifest, len(onnx_bytes), key is not None)
    if args.check:
        _print_checks(args, options, onnx_bytes)
    if options.target == "cuda" and key is None:
        print(f"TensorRT engine cache ready in {prepare_tensorrt(options, onnx_bytes)}")


def _check_flags(args: argparse.Namespace, options: CompileOptions) -> None:
    """Refuse flag combinations before compiling, as compiling can take minutes."""
    if args.check and options.insert_op_conf:
        raise CompilerError("--check feeds both models the same inputs; it cannot follow --insert-op-conf")
    if (args.layers or args.layers_csv or args.dump_dir) and not (args.check and args.layers):
        raise CompilerError("--layers extends --check, and --layers-csv / --dump-dir extend --layers: give them")


def _print_checks(args: argparse.Namespace, options: CompileOptions, onnx_bytes: bytes) -> None:
    lines = check(options, onnx_bytes, args.check_data)
    print("\n".join(lines + (check_layers(options, onnx_bytes, args) if args.layers else [])))


def _report_written(path: Path, manifest: Manifest, size: int, encrypted: bool) -> None:
    counts = manifest.node_counts
    print(f"[compile] graph optimization: {counts['before_optimization']} -> {counts['after_optimization']} "
          f"nodes ({counts['source']} in the source, {counts['compiled']} compiled)", file=sys.stderr)
    print(
        f"wrote {path} ({size / 1e6:.1f} MB{', encrypted' if encrypted else ''}): "
        f"{counts['source']} -> {counts['compiled']} nodes, precision {manifest.precision}, "
        f"quantization {manifest.quantization}, gears {manifest.batch_gears or '-'}, target {manifest.target}"
    )


def prepare_tensorrt(options: CompileOptions, onnx_bytes: bytes) -> str:
    """Build the compiled graph's TensorRT engine into the cache a GPU load of it looks in (geserve.devices.tensorrt):
    batch 1 to the largest gear, precision from the compile's. An encrypted package gets no cache (its engine would
    hold the weights in the clear), so nothing is prepared for one."""
    import onnx

    from geserve.devices import tensorrt
    from geserve.errors import GeserveError

    inputs = onnx.load_from_string(onnx_bytes).graph.input if not options.batch_gears else []
    if any(i.type.tensor_type.shape.dim and not i.type.tensor_type.shape.dim[0].HasField("dim_value") for i in inputs):
        raise CompilerError("--target cuda: the graph's batch dimension is dynamic; give --dynamic-batch-size, whose "
                            "largest gear is the largest batch of the TensorRT engine (keep max_batch_size at it)")
    precision = tensorrt.precision_of("", options.precision_mode, options.quantize)
    try:
        return str(tensorrt.prepare_engine_cache(onnx_bytes, precision, max(options.batch_gears, default=0)))
    except GeserveError as exc:
        raise CompilerError(f"the package is written, but {exc}") from None


def check(options: CompileOptions, onnx_bytes: bytes, data: Path | None, seed: int = 0) -> list[str]:
    """Run the source and the compiled model on the same inputs; one comparison line per common output."""
    import onnxruntime as ort

    from geserve.compiler.custom_ops import session_options

    graphs = (_source_graph(options), onnx_bytes)
    sessions = [ort.InferenceSession(graph, session_options(options.custom_op_libraries),
                                     providers=["CPUExecutionProvider"]) for graph in graphs]
    compiled = sessions[1]
    batches = check_inputs(compiled, onnx_bytes, options, data, seed)
    names = [o.name for o in compiled.get_outputs() if o.name in {s.name for s in sessions[0].get_outputs()}]
    if not names:
        raise CompilerError("--check: the compiled model shares no output name with the source")
    results = _collect_outputs(sessions, names, batches)
    lines = [f"check: {len(batches)} batch(es) {'from ' + str(data) if data else 'of random inputs'}"]
    return lines + [_check_line(name, golden, output) for name, (golden, output) in results.items()]


def _source_graph(options: CompileOptions) -> bytes | str:
    """The source as ONNX Runtime takes it: an ONNX file's path, else the front end's graph serialized."""
    from geserve.compiler.frontends import detect_framework, load_model

    framework = options.framework or detect_framework(options.model)
    if framework == "onnx":
        return str(options.model)
    return load_model(
        options.model, framework, options.input_shapes, options.out_nodes, options.signature
    ).SerializeToString()


def _collect_outputs(
    sessions: list[Any], names: list[str], batches: list[dict[str, Any]]
) -> dict[str, list[list[Any]]]:
    """Per output name, [the source's values, the compiled model's values], one per batch."""
    results: dict[str, list[list[Any]]] = {name: [[], []] for name in names}
    for feed in batches:
        for index, session in enumerate(sessions):
            for name, value in zip(names, session.run(names, feed), strict=True):
                results[name][index].append(value)
    return results


def check_inputs(
    compiled: Any, onnx_bytes: bytes, options: CompileOptions, data: Path | None, seed: int = 0
) -> list[dict[str, Any]]:
    """What --check feeds both models: the --check-data batches, else one batch of random inputs (`seed`), typed as
    the compiled session's inputs."""
    import numpy as np
    import onnx

    from geserve.compiler.quantize import calibration_batches
    from geserve.compiler.shapes import ORT_TYPES

    types = {i.name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ORT_TYPES[i.type])) for i in compiled.get_inputs()}
    if data is not None:
        batches = calibration_batches(data, onnx.load_from_string(onnx_bytes))
    else:
        batches = [_random_inputs(compiled, types, options.batch_gears, np.random.default_rng(seed))]
    return [{k: np.asarray(v).astype(types[k], copy=False) for k, v in batch.items()} for batch in batches]


def check_layers(options: CompileOptions, onnx_bytes: bytes, args: argparse.Namespace) -> list[str]:
    """`--check --layers`: every tensor the source and the compiled graph both compute, on --check's inputs."""
    import onnxruntime as ort

    from geserve.compiler.custom_ops import session_options
    from geserve.compiler.layer_check import run_layers

    compiled = ort.InferenceSession(onnx_bytes, session_options(options.custom_op_libraries),
                                    providers=["CPUExecutionProvider"])
    feeds = check_inputs(compiled, onnx_bytes, options, args.check_data)
    return run_layers(options, onnx_bytes, feeds, args.layers_threshold, args.layers_csv, args.dump_dir)


def _check_line(name: str, golden: list[Any], output: list[Any]) -> str:
    import numpy as np

    from geserve.compiler.compare import compare

    same = len({g.shape[1:] for g in golden}) == 1
    joined = [np.concatenate(arrays if same else [a.ravel() for a in arrays]) for arrays in (golden, output)]
    if joined[0].dtype == np.dtype(object):  # strings: equal or not
        equal = int(sum(a == b for a, b in zip(joined[0].ravel(), joined[1].ravel(), strict=True)))
        return f"check output '{name}': {equal}/{joined[0].size} strings equal"
    return "check " + compare(*joined).describe(f"output '{name}'")


def _random_inputs(session: Any, types: dict[str, Any], gears: list[int], rng: Any) -> dict[str, Any]:
    """Inputs of the compiled model's shape: dynamic batch -> the largest gear up to 4 (else 2), other -> 16;
    floats ~ N(0, 1), integers in [0, 100) (all ones for inputs named like a mask)."""
    batch = max([g for g in gears if g <= 4], default=2)
    feed = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else (batch if i == 0 else 16) for i, d in enumerate(value.shape)]
        feed[value.name] = _random_array(value.name, shape, types[value.name], rng)
    return feed


def _random_array(name: str, shape: list[int], dtype: Any, rng: Any) -> Any:
    import numpy as np

    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if "mask" in name.lower():
        return np.ones(shape, dtype)
    if dtype == np.dtype(object):  # string tensors (a custom tokenizer's, say): numbers as text
        return rng.integers(0, 100, shape).astype(str).astype(object)
    return rng.integers(0, 100, shape).astype(dtype)


def _progress(message: str) -> None:
    print(f"[compile] {message}", file=sys.stderr, flush=True)
