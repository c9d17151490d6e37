"""GPU bench (issue 16): ResNet-50 and EfficientNet-Lite0 on one NVIDIA GPU, geserve against raw ONNX Runtime on the
same execution provider, in three modes: CUDA EP FP32, CUDA EP FP16 (the compiler's force_fp16 graph, FP32 at its
edges) and the TensorRT EP in FP16 (where TensorRT's libraries are installed).

Raw ONNX Runtime: one session in this process, batches of 1, 16 and 64 back to back; its best batch is the bar.
geserve: one GPU instance (KIND_GPU, gpus [0]) with dynamic batching (max_batch_size 64), driven over gRPC by client
processes that resend one prebuilt ModelInferRequest (batch 1, raw tensor bytes) at concurrency 1, 16 and 64;
ResNet-50 FP16 also without batching at 64. Each row is printed when measured and bench/results/gpu.md is rewritten
after every row, so a run cut short by its time budget keeps what it measured. Targets (issue 16): dynamic batching
at c=64 >= 3x no batching on ResNet-50 FP16; geserve >= 0.9x raw ONNX Runtime at its best batch.

    python bench/gpu_bench.py                    # the GPU run (scripts/gpu_check.sh calls it)
    python bench/gpu_bench.py --provider cpu --models mlp --seconds 0.5 --out /tmp/cpu.md   # a smoke run here
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCHES = (1, 16, 64)
CONCURRENCY = (1, 16, 64)
MAX_BATCH = 64


@dataclass
class Row:
    model: str
    mode: str
    system: str  # "raw onnxruntime b=N", "geserve c=N", "geserve no batching c=N"
    throughput: float | None  # images per second
    p50_ms: float | None
    note: str = ""


# ---- models ---------------------------------------------------------------------------------------------


def source_model(name: str, work: Path) -> Path | None:
    """The FP32 ONNX file: the example repository's, the bundle's (gpu_check.sh), or torchvision's ResNet-50."""
    built = ROOT / "examples" / "model_repository" / name / "1" / "model.onnx"
    if built.is_file():
        return built
    carried = Path(os.environ.get("GESERVE_GPU_BUNDLE", "/tmp/geserve-gpu/bundle")) / f"{name}.onnx"
    if carried.is_file():
        return carried
    if name == "resnet50":
        return _torchvision_resnet50(work / "resnet50.onnx")
    return None


def _torchvision_resnet50(path: Path) -> Path | None:
    try:
        import torch
        import torchvision
    except ImportError:
        return None
    model = torchvision.models.resnet50(weights=None).eval()
    torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), str(path), input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=17, dynamo=False)
    return path


def fp16_model(source: Path, work: Path) -> Path:
    """The compiler's force_fp16 graph (inputs and outputs stay FP32), as `geserve compile` writes it, unpacked."""
    from geserve.compiler import CompileOptions
    from geserve.compiler.pipeline import compile_model

    _, onnx_bytes = compile_model(CompileOptions(model=source, precision_mode="force_fp16", target="cuda"))
    path = work / f"{source.parent.parent.name if source.name == 'model.onnx' else source.stem}_fp16.onnx"
    path.write_bytes(onnx_bytes)
    return path


# ---- raw ONNX Runtime -------------------------------------------------------------------------------------


def providers_for(mode: str, provider: str, graph: Path, cache: Path) -> list[Any]:
    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if mode == "trt_fp16":
        from geserve.devices import tensorrt

        inputs = _inputs(graph)
        options = tensorrt.tensorrt_options(tensorrt.graph_digest(graph), "fp16",
                                            tensorrt.profile_shapes([(n, s) for n, s, _ in inputs], MAX_BATCH), {},
                                            root=cache)
        return [("TensorrtExecutionProvider", {"device_id": 0, **options}), ("CUDAExecutionProvider", {"device_id": 0})]
    return [("CUDAExecutionProvider", {"device_id": 0})]


def _inputs(graph: Path) -> list[tuple[str, list[int], str]]:
    import onnxruntime as ort

    probe = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    return [(i.name, [d if isinstance(d, int) else -1 for d in i.shape], i.type) for i in probe.get_inputs()]


def raw_rows(model: str, mode: str, graph: Path, provider: str, seconds: float, cache: Path) -> list[Row]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(graph), options, providers=providers_for(mode, provider, graph, cache))
    (name, shape, _), = _inputs(graph)
    rows = []
    for batch in BATCHES:
        feed = {name: np.random.rand(batch, *shape[1:]).astype(np.float32)}
        session.run(None, feed)  # warm-up (and, with TensorRT, the engine for this shape)
        times = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - started)
        rows.append(Row(model, mode, f"raw onnxruntime b={batch}", batch * len(times) / sum(times),
                        1000 * statistics.median(times)))
    return rows


# ---- geserve ------------------------------------------------------------------------------------------------


def write_repository(repo: Path, model: str, mode: str, graph: Path, provider: str, no_batching: bool) -> list[str]:
    kind = "KIND_CPU" if provider == "cpu" else "KIND_GPU gpus: [ 0 ]"
    trt = ('optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" '
           'parameters { key: "precision_mode" value: "FP16" } } ] } }') if mode == "trt_fp16" else ""
    names = []
    for name, batching in ((model, True), *(((f"{model}_nb", False),) if no_batching else ())):
        folder = repo / name / "1"
        folder.mkdir(parents=True)
        (folder / "model.onnx").symlink_to(graph.resolve())
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {MAX_BATCH}\n'
            f"instance_group [ {{ count: 1 kind: {kind} }} ]\n"
            + ("dynamic_batching { }\n" if batching else "") + trt + "\n"
        )
        names.append(name)
    return names


def _client(url: str, model: str, input_name: str, shape: list[int], concurrency: int, warmup: float,
            seconds: float, barrier: Any, results: Any) -> None:
    """One client process: connects and warms up, waits for the others (`barrier`), then runs `concurrency` loops
    resending one request and keeps the latencies of the answers that fall inside the measuring window."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = input_name, "FP32"
    tensor.shape.extend(shape)
    request.raw_input_contents.append(np.random.rand(*shape).astype(np.float32).tobytes())

    async def run() -> list[float]:
        latencies: list[float] = []
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        async with grpc.aio.insecure_channel(url, options=options) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            await stub.ModelInfer(request)
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
            start = time.monotonic() + warmup
            end = start + seconds

            async def loop() -> None:
                while True:
                    sent = time.monotonic()
                    await stub.ModelInfer(request)
                    done = time.monotonic()
                    if sent >= start and done <= end:
                        latencies.append(done - sent)
                    if done > end:
                        return

            await asyncio.gather(*(loop() for _ in range(concurrency)))
        return latencies

    results.put(asyncio.run(run()))


def served_row(url: str, model: str, mode: str, served: str, system: str, input_name: str, shape: list[int],
               concurrency: int, seconds: float) -> Row:
    context = multiprocessing.get_context("spawn")
    processes = min(concurrency, 8)
    results = context.Queue()
    barrier = context.Barrier(processes)
    warmup = min(1.0, seconds / 2)
    workers = [context.Process(target=_client, args=(url, served, input_name, [1, *shape[1:]],
                                                      concurrency // processes + (i < concurrency % processes),
                                                      warmup, seconds, barrier, results))
               for i in range(processes)]
    for worker in workers:
        worker.start()
    latencies: list[float] = []
    for _ in workers:
        latencies += results.get(timeout=seconds + 120)
    for worker in workers:
        worker.join()
    if not latencies:
        return Row(model, mode, system, None, None, "no answer inside the window")
    return Row(model, mode, system, len(latencies) / seconds, 1000 * statistics.median(latencies))


def geserve_rows(model: str, mode: str, graph: Path, provider: str, seconds: float, work: Path, cache: Path,
                 emit: Any) -> None:
    from tests.support.reference import free_port

    repo = work / f"repo_{model}_{mode}"
    no_batching = (model == "resnet50" and mode == "cuda_fp16") or provider == "cpu"
    names = write_repository(repo, model, mode, graph, provider, no_batching)
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    log = open(work / f"server_{model}_{mode}.log", "wb")  # noqa: SIM115 - closed below
    env = {**os.environ, "GESERVE_CACHE_DIR": str(cache)}
    server = subprocess.Popen([sys.executable, "-m", "geserve", "serve", "--model-repository", str(repo),
                               "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port",
                               str(metrics), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        if not _wait_ready(http, names, server, timeout=300):
            emit(Row(model, mode, "geserve", None, None, f"server not ready; see {log.name}"))
            return
        (name, shape, _), = _inputs(graph)
        url = f"127.0.0.1:{grpc_port}"
        for concurrency in CONCURRENCY:
            emit(served_row(url, model, mode, names[0], f"geserve c={concurrency}", name, shape, concurrency,
                            seconds))
        if len(names) > 1:
            emit(served_row(url, model, mode, names[1], "geserve no batching c=64", name, shape, 64, seconds))
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _wait_ready(port: int, names: list[str], server: subprocess.Popen, timeout: float) -> bool:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            for name in names:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{name}/ready", timeout=2):
                    pass
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    return False


# ---- report --------------------------------------------------------------------------------------------------


def tensorrt_usable() -> str | None:
    import onnxruntime as ort

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no TensorrtExecutionProvider"
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "TensorRT's libraries (the tensorrt wheels) are not installed"
    return None


def cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def report(rows: list[Row], meta: list[str], skipped: list[str]) -> str:
    lines = ["# GPU bench (issue 16)", "", *meta, "",
             "| model | mode | system | img/s | p50 ms | note |", "|---|---|---|---:|---:|---|"]
    lines += [f"| {r.model} | {r.mode} | {r.system} | {cell(r.throughput)} | {cell(r.p50_ms, 2)} | {r.note} |"
              for r in rows]
    lines += ["", "## Targets", ""]
    lines += targets(rows) or ["- not measured"]
    if skipped:
        lines += ["", "## Not measured", "", *(f"- {s}" for s in skipped)]
    return "\n".join(lines) + "\n"


def targets(rows: list[Row]) -> list[str]:
    def get(model: str, mode: str, system: str) -> float | None:
        found = [r.throughput for r in rows if (r.model, r.mode, r.system) == (model, mode, system)]
        return found[0] if found else None

    lines = []
    batched, single = get("resnet50", "cuda_fp16", "geserve c=64"), get("resnet50", "cuda_fp16",
                                                                        "geserve no batching c=64")
    if batched and single:
        ratio = batched / single
        lines.append(f"- ResNet-50 FP16, dynamic batching vs none at c=64: {ratio:.2f}x "
                     f"({'met' if ratio >= 3 else 'NOT met'}: >= 3x)")
    for model, mode in sorted({(r.model, r.mode) for r in rows}):
        raw = [r.throughput for r in rows if (r.model, r.mode) == (model, mode) and r.system.startswith("raw")
               and r.throughput]
        served = [r.throughput for r in rows if (r.model, r.mode) == (model, mode)
                  and r.system.startswith("geserve c=") and r.throughput]
        if raw and served:
            ratio = max(served) / max(raw)
            lines.append(f"- {model} {mode}: geserve's best {max(served):,.0f} img/s vs raw ONNX Runtime's best batch "
                         f"{max(raw):,.0f} img/s = {ratio:.2f}x ({'met' if ratio >= 0.9 else 'NOT met'}: >= 0.9x)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,efficientnet_lite0")
    parser.add_argument("--modes", default="cuda_fp16,cuda_fp32,trt_fp16")
    parser.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring window of each cell")
    parser.add_argument("--budget", type=float, default=330.0, help="stop starting new cells after this many s")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu.md")
    args = parser.parse_args()
    began = time.monotonic()
    import onnxruntime as ort

    meta = [f"- onnxruntime {ort.__version__}, providers {', '.join(ort.get_available_providers())}",
            f"- {_gpu_name()}", f"- each cell: {args.seconds:g} s window; batch-1 requests over gRPC for geserve"]
    rows: list[Row] = []
    skipped: list[str] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def emit(row: Row) -> None:
        rows.append(row)
        print(f"| {row.model} | {row.mode} | {row.system} | {cell(row.throughput)} img/s | "
              f"p50 {cell(row.p50_ms, 2)} ms | {row.note}", flush=True)
        args.out.write_text(report(rows, meta, skipped))

    no_trt = tensorrt_usable() if args.provider == "cuda" else "CPU smoke run"
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        cache = work / "cache"
        for model in args.models.split(","):
            source = source_model(model, work)
            if source is None:
                skipped.append(f"{model}: no ONNX file (build the examples, or carry it in the bundle)")
                continue
            for mode in args.modes.split(","):
                if mode == "trt_fp16" and no_trt:
                    skipped.append(f"{model} {mode}: {no_trt}")
                    continue
                if time.monotonic() - began > args.budget:
                    skipped.append(f"{model} {mode}: out of the run's time budget ({args.budget:g} s)")
                    continue
                graph = fp16_model(source, work) if mode == "cuda_fp16" else source
                try:
                    for row in raw_rows(model, mode, graph, args.provider, args.seconds / 2, cache):
                        emit(row)
                    geserve_rows(model, mode, graph, args.provider, args.seconds, work, cache, emit)
                except Exception as exc:  # one broken cell must not cost the others
                    emit(Row(model, mode, "error", None, None, f"{type(exc).__name__}: {str(exc)[:160]}"))
    args.out.write_text(report(rows, meta, skipped))
    print(f"wrote {args.out} in {time.monotonic() - began:.0f} s")
    return 0


def _gpu_name() -> str:
    try:
        output = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20, check=False).stdout.strip()
        return f"GPU: {output}" if output else "GPU: none seen by nvidia-smi"
    except (OSError, subprocess.TimeoutExpired):
        return "GPU: nvidia-smi not found"


if __name__ == "__main__":
    raise SystemExit(main())
