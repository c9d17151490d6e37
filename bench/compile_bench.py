"""`geserve compile` on ResNet-50 and EfficientNet-Lite0: FP32 vs FP16 vs INT8 latency and throughput with raw
ONNX Runtime, file size, compile time, accuracy vs the source; and first load (compile) vs cached load through
the server.

Run: `.venv/bin/python bench/compile_bench.py [--runs 10] [--models resnet50,efficientnet_lite0]`;
writes bench/results/compile.md. Alternates the variants round by round so a noisy shared CPU hits them alike;
reports medians. Targets (issue 6): INT8 >= 1.8x FP32 throughput; cached load >= 5x faster than a compiling one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from geserve.compiler import CompileOptions  # noqa: E402
from geserve.compiler.compare import compare  # noqa: E402
from geserve.compiler.pipeline import compile_model  # noqa: E402
from tests.support.server import geserve  # noqa: E402

PHOTOS = ("chelsea", "coffee", "astronaut")
CALIBRATION_PHOTOS = ("rocket", "camera", "immunohistochemistry", "colorwheel")
THROUGHPUT_BATCH = 8


def _photos(names: tuple[str, ...]) -> np.ndarray:
    import skimage.data
    from build_efficientnet import preprocess

    return np.stack([preprocess(getattr(skimage.data, name)()) for name in names])


def _inputs(model: str) -> tuple[np.ndarray, np.ndarray]:
    """(calibration batch, evaluation batch): real photos for EfficientNet, random images for ResNet-50."""
    if model == "efficientnet_lite0":
        return _photos(CALIBRATION_PHOTOS), _photos(PHOTOS)
    rng = np.random.default_rng(0)
    return rng.random((8, 3, 224, 224), dtype=np.float32), rng.random((3, 3, 224, 224), dtype=np.float32)


def _session(graph: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def bench_model(model: str, runs: int, threads: int, scratch: Path) -> list[str]:
    source = ROOT / "examples" / "model_repository" / model / "1" / "model.onnx"
    calibration_batch, evaluation = _inputs(model)
    calibration = scratch / f"{model}-calib"
    calibration.mkdir()
    np.save(calibration / "images.npy", calibration_batch)
    variants = {
        "source (no compile)": None,
        "FP32 (force_fp32)": CompileOptions(model=source),
        "FP16 (allow_fp32_to_fp16)": CompileOptions(model=source, precision_mode="allow_fp32_to_fp16"),
        "INT8 QOperator (cpu)": CompileOptions(model=source, quantize="int8", calibration_data=calibration),
    }
    rows: dict[str, dict] = {}
    sessions: dict[str, ort.InferenceSession] = {}
    for name, options in variants.items():
        started = time.perf_counter()
        if options is None:
            graph, nodes = source.read_bytes(), "-"
        else:
            manifest, graph = compile_model(options, progress=lambda _m: None)
            nodes = f"{manifest.node_counts['before_optimization']} -> {manifest.node_counts['after_optimization']}"
        rows[name] = {"compile_s": time.perf_counter() - started if options else 0.0, "size_mb": len(graph) / 1e6,
                      "nodes": nodes, "b1": [], "b8": []}
        sessions[name] = _session(graph, threads)
    reference = sessions["source (no compile)"].run(None, {"input": evaluation})[0]
    for name, session in sessions.items():
        result = compare(reference, session.run(None, {"input": evaluation})[0])
        rows[name] |= {"cosine": result.cosine, "top1": f"{round((result.top1 or 0) * result.rows)}/{result.rows}"}
    one = evaluation[:1]
    batch = np.ascontiguousarray(np.resize(evaluation, (THROUGHPUT_BATCH, *evaluation.shape[1:])))
    for _ in range(runs):
        for name, session in sessions.items():
            for key, x in (("b1", one), ("b8", batch)):
                started = time.perf_counter()
                session.run(None, {"input": x})
                rows[name][key].append(time.perf_counter() - started)
    fp32 = THROUGHPUT_BATCH / statistics.median(rows["FP32 (force_fp32)"]["b8"])
    about = (" (random weights, random images)" if model == "resnet50" else
             f" (real weights; photos {', '.join(PHOTOS)}; INT8 calibrated on {', '.join(CALIBRATION_PHOTOS)})")
    lines = [
        f"## {model}{about}",
        "",
        f"| variant | compile s | file MB | nodes optimized | batch-1 p50 ms | batch-{THROUGHPUT_BATCH} images/s "
        f"| throughput vs FP32 | cosine vs source | top-1 same |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        rate = THROUGHPUT_BATCH / statistics.median(row["b8"])
        lines.append(f"| {name} | {row['compile_s']:.1f} | {row['size_mb']:.1f} | {row['nodes']} "
                     f"| {statistics.median(row['b1']) * 1000:.1f} | {rate:.1f} | {rate / fp32:.2f}x "
                     f"| {row['cosine']:.4f} | {row['top1']} |")
    int8 = THROUGHPUT_BATCH / statistics.median(rows["INT8 QOperator (cpu)"]["b8"]) / fp32
    lines += ["", f"Target INT8 >= 1.8x FP32 throughput: {int8:.2f}x, {'met' if int8 >= 1.8 else 'NOT met'}.", ""]
    return lines


def _time_until_ready(repo: Path, model: str, log: Path) -> float:
    started = time.perf_counter()
    with geserve([repo], log) as server:
        while True:
            try:
                with urllib.request.urlopen(f"{server.base}/v2/models/{model}/ready", timeout=5) as response:
                    if response.status == 200:
                        return time.perf_counter() - started
            except urllib.error.URLError:
                pass
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"{model} not ready after 600 s; see {log}")
            time.sleep(0.05)


def _logged_load_s(log: Path, model: str) -> float:
    """Seconds between the server's first log line and "successfully loaded '<model>'" (no interpreter start)."""
    from datetime import datetime

    stamps = [(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f"), line) for line in log.read_text().splitlines()
              if line[:2] == "20" and len(line) > 23]
    done = next(stamp for stamp, line in stamps if f"successfully loaded '{model}'" in line)
    return (done - stamps[0][0]).total_seconds()


def bench_loads(model: str, scratch: Path) -> str:
    """Start a server on a repository holding model.onnx + compile_quantize int8: cold cache, then warm cache."""
    repo = scratch / f"{model}-repo"
    version = repo / model / "1"
    version.mkdir(parents=True)
    source_dir = ROOT / "examples" / "model_repository" / model
    shutil.copy(source_dir / "1" / "model.onnx", version / "model.onnx")
    if (source_dir / "labels.txt").is_file():
        shutil.copy(source_dir / "labels.txt", repo / model / "labels.txt")
    (repo / model / "calib").mkdir()
    np.save(repo / model / "calib" / "images.npy", _inputs(model)[0])
    (repo / model / "config.pbtxt").write_text(
        (source_dir / "config.pbtxt").read_text()
        + 'parameters { key: "compile_quantize" value: { string_value: "int8" } }\n'
        + 'parameters { key: "compile_calibration_data" value: { string_value: "calib" } }\n'
    )
    os.environ["GESERVE_CACHE_DIR"] = str(scratch / f"{model}-cache")
    first = _time_until_ready(repo, model, scratch / f"{model}-first.log")
    cached = _time_until_ready(repo, model, scratch / f"{model}-cached.log")
    hit = "using cached compiled model" in (scratch / f"{model}-cached.log").read_text()
    first_load, cached_load = (_logged_load_s(scratch / f"{model}-{run}.log", model) for run in ("first", "cached"))
    return (f"| {model} | {first:.1f} | {cached:.1f} | {first / cached:.1f}x | {first_load:.2f} | {cached_load:.2f} "
            f"| {first_load / cached_load:.1f}x | {hit} | {'met' if first_load / cached_load >= 5 else 'NOT met'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="resnet50,efficientnet_lite0")
    args = parser.parse_args(argv)
    from build import main as build_examples

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    build_examples([arg for model in models for arg in ("--only", model)])
    scratch = Path(tempfile.mkdtemp(prefix="geserve-compile-bench-"))
    lines = [
        "# geserve compile: precision variants and compile-on-first-load",
        "",
        f"Raw ONNX Runtime CPU, {args.threads} intra-op threads, {args.runs} alternating runs per variant and batch "
        f"size on a shared 2-vCPU machine; medians. Throughput: batch {THROUGHPUT_BATCH}. 'nodes optimized': the "
        f"FP32 graph before -> after ONNX Runtime's offline optimizer.",
        "",
    ]
    for model in models:
        lines += bench_model(model, args.runs, args.threads, scratch)
    lines += [
        "## Compile-on-first-load through the server (INT8, `compile_quantize` parameter)",
        "",
        "Start to READY: seconds from starting `geserve serve` until the model answers READY (includes the Python "
        "interpreter and imports, ~0.5 s). Load: from the server's first log line to \"successfully loaded\" "
        "(the repository load itself). The second start reuses the first's GESERVE_CACHE_DIR. The target is "
        "judged on the load.",
        "",
        "| model | start to READY, compiling s | start to READY, cached s | speedup | load, compiling s "
        "| load, cached s | load speedup | cache hit | target >= 5x |",
        "|---|---|---|---|---|---|---|---|---|",
        *(bench_loads(model, scratch) for model in models),
        "",
    ]
    text = "\n".join(lines)
    out_path = ROOT / "bench" / "results" / "compile.md"
    out_path.write_text(text)
    print(text)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
