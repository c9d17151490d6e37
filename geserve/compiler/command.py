"""`geserve compile`: runs a compile (or prints a package's manifest) and turns errors into one line + exit code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from geserve.compiler.errors import CompilerError
from geserve.compiler.options import CompileOptions, parse_bool, parse_input_shapes, parse_int_list
from geserve.compiler.package import load_key, read_manifest, write_package

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
    lines.append(f"  {'options':<17} {json.dumps(data['options'], sort_keys=True)}")
    return "\n".join(lines)


def options_from_args(args: argparse.Namespace) -> CompileOptions:
    return CompileOptions(
        model=args.model,
        framework=args.framework or "",
        input_shapes=parse_input_shapes(args.input_shape or ""),
        batch_gears=parse_int_list(args.dynamic_batch_size or "", "--dynamic-batch-size"),
        out_nodes=[n.strip() for n in (args.out_nodes or "").replace(";", ",").split(",") if n.strip()],
        precision_mode=args.precision_mode,
        keep_io_types=parse_bool(args.keep_io_types, "--keep-io-types"),
        quantize=args.quantize,
        calibration_data=args.calibration_data,
        insert_op_conf=args.insert_op_conf,
        target=args.target,
        optimize=not args.no_optimize,
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.info:
            print(format_manifest(args.model))
            return EXIT_OK
        if args.output is None:
            print("error: geserve compile needs --output OUT.gem (or --info)", file=sys.stderr)
            return EXIT_USAGE
        from geserve.compiler.pipeline import compile_model

        options = options_from_args(args)
        key = load_key(args.encrypt_key_file, env="") if args.encrypt_key_file else None
        quiet = args.quiet or not sys.stderr.isatty()
        manifest, onnx_bytes = compile_model(options, None if quiet else _progress)
        path = write_package(args.output, manifest, onnx_bytes, key)
        counts = manifest.node_counts
        print(
            f"wrote {path} ({len(onnx_bytes) / 1e6:.1f} MB{', encrypted' if key else ''}): "
            f"{counts['source']} -> {counts['compiled']} nodes, precision {manifest.precision}, "
            f"quantization {manifest.quantization}, gears {manifest.batch_gears or '-'}, target {manifest.target}"
        )
        return EXIT_OK
    except CompilerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _progress(message: str) -> None:
    print(f"[compile] {message}", file=sys.stderr, flush=True)
