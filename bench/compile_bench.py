"""ResNet-50 through `geserve compile`: FP32 vs FP16 vs INT8 latency with raw ONNX Runtime, size, compile time.

Run: `.venv/bin/python bench/compile_bench.py [--runs 20]`; writes bench/results/compile.md.
Alternates the variants round by round so a noisy shared CPU hits them alike; reports medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from geserve.compiler import CompileOptions, read_package  # noqa: E402
from geserve.compiler.cache import compile_cached  # noqa: E402
from geserve.compiler.pipeline import compile_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from build import main as build_examples

    build_examples(["--only", "resnet50"])
    source = ROOT / "examples" / "model_repository" / "resnet50" / "1" / "model.onnx"
    scratch = Path(tempfile.mkdtemp(prefix="geserve-compile-bench-"))
    calibration = scratch / "calib"
    calibration.mkdir()
    np.save(calibration / "images.npy", np.random.default_rng(0).random((8, 3, 224, 224), dtype=np.float32))
    variants = {
        "source (no compile)": None,
        "FP32 (force_fp32)": CompileOptions(model=source),
        "FP16 (allow_fp32_to_fp16)": CompileOptions(model=source, precision_mode="allow_fp32_to_fp16"),
        "INT8 QOperator (cpu)": CompileOptions(model=source, quantize="int8", calibration_data=calibration),
    }
    graphs: dict[str, bytes] = {}
    rows: dict[str, dict] = {}
    for name, options in variants.items():
        if options is None:
            graphs[name] = source.read_bytes()
            rows[name] = {"compile_s": 0.0}
            continue
        started = time.perf_counter()
        _, graphs[name] = compile_model(options, progress=lambda _m: None)
        rows[name] = {"compile_s": time.perf_counter() - started}
    sessions = {}
    for name, graph in graphs.items():
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sessions[name] = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        rows[name] |= {"size_mb": len(graph) / 1e6, "latency": []}
    x = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    reference = sessions["source (no compile)"].run(None, {"input": x})[0]
    for name, session in sessions.items():
        out = session.run(None, {"input": x})[0]
        rows[name]["top1"] = bool(out.argmax() == reference.argmax())
        rows[name]["max_abs"] = float(np.abs(out - reference).max())
    for _ in range(args.runs):
        for name, session in sessions.items():
            started = time.perf_counter()
            session.run(None, {"input": x})
            rows[name]["latency"].append((time.perf_counter() - started) * 1000)
    # First load that compiles vs a cached load (the server's compile-on-first-load path).
    cache = scratch / "cache"
    options = CompileOptions(model=source, quantize="int8", calibration_data=calibration)
    started = time.perf_counter()
    path, _ = compile_cached(options, cache)
    read_package(path)
    first = time.perf_counter() - started
    started = time.perf_counter()
    path, hit = compile_cached(options, cache)
    read_package(path)
    cached = time.perf_counter() - started
    base = statistics.median(rows["FP32 (force_fp32)"]["latency"])
    lines = [
        "# geserve compile: ResNet-50 (random weights), batch 1, raw ONNX Runtime CPU",
        "",
        f"{args.runs} alternating runs per variant, {args.threads} intra-op threads, shared 2-vCPU machine; medians.",
        "",
        "| variant | compile s | file MB | p50 ms | speed vs FP32 | max abs diff vs source | top-1 same |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        p50 = statistics.median(row["latency"])
        lines.append(f"| {name} | {row['compile_s']:.1f} | {row['size_mb']:.1f} | {p50:.1f} | {base / p50:.2f}x "
                     f"| {row['max_abs']:.3g} | {row['top1']} |")
    lines += ["", f"Compile-on-first-load (INT8): first load {first:.1f} s, cached load {cached:.2f} s "
              f"({first / cached:.0f}x faster; cache hit: {hit}).", ""]
    text = "\n".join(lines)
    out_path = ROOT / "bench" / "results" / "compile.md"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
