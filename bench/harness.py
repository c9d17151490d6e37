"""Benchmark harness: raw ONNX Runtime, geserve and the real Triton on the example models, side by side.

Alternates the systems over several rounds in one run (so machine noise hits all alike) and reports the
median per cell: raw in-process ONNX Runtime (geserve's session options; batch 1 and the best batch size),
geserve, and Triton 2.51 serving the same ONNX files through Python-backend models without and with
dynamic batching, each driven by perf_analyzer at concurrency 1, 4 and 16. Writes bench/results/harness.md,
harness.json and harness.png, and checks the speed targets of issue 3.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import TypeVar

import numpy as np
import onnxruntime as ort
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geserve.devices import threads_per_instance  # noqa: E402
from geserve.tune.machine import others_share  # noqa: E402  (other processes' CPU share, from /proc)
from geserve.tune.machine import wait_for_quiet as machine_quiet  # noqa: E402
from geserve.version import __version__ as geserve_version  # noqa: E402
from tests.support import reference  # noqa: E402
from tests.support.server import geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples" / "model_repository"
CONCURRENCIES = (1, 4, 16)
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SYSTEMS = {
    "geserve": "geserve",
    "geserve_db": "geserve + dynamic batching",
    "triton": "Triton",
    "triton_db": "Triton + dynamic batching",
}
PROTOCOLS = ("http", "grpc")
DB_SUFFIX = "_db"  # geserve serves each model twice: as configured, and with `dynamic_batching {}` added
NUMPY_TYPES = {"TYPE_FP32": np.float32, "TYPE_FP16": np.float16, "TYPE_INT64": np.int64, "TYPE_INT32": np.int32}
BUSY_LIMIT = 0.15  # share of the CPUs used by other processes above which a measurement is redone
T = TypeVar("T")


@dataclass(frozen=True)
class Mode:
    rounds: int
    window_ms: int  # shortest perf_analyzer measurement window
    requests_per_window: int  # windows grow so that c=1 completes about this many requests
    stability: int  # perf_analyzer --stability-percentage (retried once at 100 when it never settles)
    max_trials: int
    raw_budget_s: float  # seconds per raw ONNX Runtime measurement (per batch size)
    quiet_wait_s: float  # the run's total time for waiting on other processes to leave the CPUs


QUICK = Mode(rounds=1, window_ms=1000, requests_per_window=30, stability=50, max_trials=6, raw_budget_s=0.5,
             quiet_wait_s=60)
FULL = Mode(rounds=3, window_ms=2000, requests_per_window=60, stability=25, max_trials=8, raw_budget_s=1.5,
            quiet_wait_s=240)


@dataclass(frozen=True)
class Endpoint:
    system: str  # a SYSTEMS key
    protocol: str  # perf_analyzer -i
    url: str  # host:port
    http_url: str = ""  # host:port of the same server's HTTP endpoint (warm-up, version)
    model_suffix: str = ""

    @property
    def key(self) -> str:
        return f"{self.system}/{self.protocol}"


@dataclass(frozen=True)
class Point:
    throughput: float  # infer/s (rows/s for raw batches)
    p50_us: float
    p99_us: float


@dataclass
class RawResult:
    p50_us: float
    p99_us: float
    throughput: dict[int, float]  # batch size -> rows/s


@dataclass
class Samples:
    """Every round's measurements: raw[model], served[model][endpoint key][concurrency]."""

    raw: dict[str, list[RawResult]] = field(default_factory=dict)
    served: dict[str, dict[str, dict[int, list[Point]]]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    others: dict[str, list[float]] = field(default_factory=dict)  # CPU share used by other processes, per cell
    quiet_budget_s: float = 0.0  # what is left of the run's time for waiting on other processes
    loose: list[str] = field(default_factory=list)  # cells that only settled at stability 100%


# ------------------------------------------------------------------------------------------ models


def load_config(model_dir: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def onnx_path(model_dir: Path, config: model_config_pb2.ModelConfig) -> Path:
    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.name.isdigit())
    return model_dir / str(versions[-1]) / (config.default_model_filename or "model.onnx")


def random_inputs(config: model_config_pb2.ModelConfig, batch: int) -> dict[str, np.ndarray]:
    """Random tensors for every input at ``batch`` rows; fixed dims only (what perf_analyzer sends too)."""
    rng = np.random.default_rng(0)
    feeds = {}
    for tensor in config.input:
        dims = list(tensor.dims)
        if -1 in dims:
            raise SystemExit(f"{config.name}: input '{tensor.name}' has variable dims; not supported here")
        dtype = NUMPY_TYPES[model_config_pb2.DataType.Name(tensor.data_type)]
        feeds[tensor.name] = rng.standard_normal([batch, *dims]).astype(dtype)
    return feeds


def instance_count(config: model_config_pb2.ModelConfig) -> int:
    return sum(max(1, group.count) for group in config.instance_group) or 1


# ------------------------------------------------------------------------------- raw ONNX Runtime


def geserve_session(path: Path, threads: int) -> ort.InferenceSession:
    """The session options geserve's GE backend uses by default (geserve/backends/ge/backend.py)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.enable_cpu_mem_arena = True
    options.enable_mem_pattern = True
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def timed_calls(session: ort.InferenceSession, feeds: dict[str, np.ndarray], budget_s: float) -> list[float]:
    """Seconds per session.run, for ``budget_s`` (at least 3 calls) after a warm-up of a tenth of that."""
    warm_until = time.perf_counter() + budget_s / 10
    session.run(None, feeds)
    while time.perf_counter() < warm_until:
        session.run(None, feeds)
    samples: list[float] = []
    stop = time.perf_counter() + budget_s
    while len(samples) < 3 or time.perf_counter() < stop:
        start = time.perf_counter()
        session.run(None, feeds)
        samples.append(time.perf_counter() - start)
    return samples


def raw_session(model_dir: Path) -> tuple[model_config_pb2.ModelConfig, ort.InferenceSession]:
    """The model's config and one session with geserve's options and the threads one of its instances gets."""
    config = load_config(model_dir)
    return config, geserve_session(onnx_path(model_dir, config), threads_per_instance(instance_count(config)))


def rows_per_second(session: ort.InferenceSession, config: model_config_pb2.ModelConfig, batch: int,
                    budget_s: float) -> float:
    calls = timed_calls(session, random_inputs(config, batch), budget_s)
    return batch * len(calls) / sum(calls)


def raw_onnxruntime(model_dir: Path, budget_s: float) -> RawResult:
    """Batch-1 latency and rows/s per batch size of one in-process session (runs in a child process)."""
    config, session = raw_session(model_dir)
    latency = timed_calls(session, random_inputs(config, 1), budget_s)
    throughput = {batch: rows_per_second(session, config, batch, budget_s)
                  for batch in BATCH_SIZES if batch <= max(1, config.max_batch_size)}
    micros = np.array(latency) * 1e6
    return RawResult(float(np.percentile(micros, 50)), float(np.percentile(micros, 99)), throughput)


def raw_rows(model_dir: Path, batch: int, budget_s: float) -> float:
    """Rows/s of one in-process session at one batch size (runs in a child process)."""
    config, session = raw_session(model_dir)
    return rows_per_second(session, config, batch, budget_s)


def in_child(function: Callable[..., T], *args: object) -> T:
    """`function(*args)` in a fresh process, so its ONNX Runtime thread pool never competes with a server."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


# ---------------------------------------------------------------------------------- perf_analyzer


def served_count(http: str, model: str) -> int:
    """The successful inferences a server's statistics count for `model` (all versions), over HTTP at host:port."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as answer:
        stats = json.load(answer)
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def perf_analyzer_args(endpoint: Endpoint, model: str, concurrency: int, window_ms: int, stability: int,
                       mode: Mode, csv_path: Path) -> list[str]:
    return [
        "-m", model + endpoint.model_suffix, "-u", endpoint.url, "-i", endpoint.protocol,
        "--concurrency-range", str(concurrency),
        "--measurement-interval", str(window_ms),
        "--stability-percentage", str(stability),
        "--max-trials", str(mode.max_trials),
        "-f", str(csv_path),
    ]  # fmt: skip


def read_csv_point(csv_path: Path) -> Point | None:
    if not csv_path.is_file():
        return None
    with csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return None
    row = rows[0]
    return Point(float(row["Inferences/Second"]), float(row["p50 latency"]), float(row["p99 latency"]))


def perf_analyzer(endpoint: Endpoint, model: str, concurrency: int, window_ms: int, mode: Mode,
                  samples: Samples) -> Point | None:
    """One perf_analyzer run; retried once at --stability-percentage 100 and 3x the window when it gives nothing."""
    for stability, window in ((mode.stability, window_ms), (100, 3 * window_ms)):
        with tempfile.TemporaryDirectory(prefix="harness-pa-") as tmp:
            csv_path = Path(tmp) / "pa.csv"
            args = perf_analyzer_args(endpoint, model, concurrency, window, stability, mode, csv_path)
            result = reference.run_perf_analyzer(args, timeout=60 + mode.max_trials * window / 1000 * 2)
            point = read_csv_point(csv_path)
        samples.commands[f"{model} {endpoint.key} c={concurrency}"] = ["perf_analyzer", *args[:-2]]
        if point is not None:
            if stability == 100:
                samples.loose.append(f"{model} {endpoint.key} c={concurrency}")
            return point
    print(f"  perf_analyzer gave no result: {(result.stdout + result.stderr)[-800:]}", file=sys.stderr)
    return None


# ------------------------------------------------------------------------------------------ servers


def wait_for_quiet(max_wait_s: float) -> bool:
    """Wait (up to ``max_wait_s``) until others use at most BUSY_LIMIT of the CPUs over half a second."""
    return machine_quiet(BUSY_LIMIT, max_wait_s)


def link_model_files(model: str, folder: Path) -> Path:
    """`folder`, made to hold an example model's files (symlinks), all but its config: the caller writes its own."""
    folder.mkdir(parents=True)
    for item in (EXAMPLES / model).iterdir():
        if item.name not in ("config.pbtxt", ".stamp"):
            (folder / item.name).symlink_to(item, target_is_directory=item.is_dir())
    return folder


def model_repository(models: list[str], dest: Path, delay_us: int = 0) -> Path:
    """The benchmarked models as configured (symlinks), and each again with dynamic batching turned on (with a
    `max_queue_delay_microseconds` of `delay_us`)."""
    dest.mkdir(parents=True, exist_ok=True)
    for model in models:
        (dest / model).symlink_to(EXAMPLES / model, target_is_directory=True)
        batched = link_model_files(model, dest / (model + DB_SUFFIX))
        config = load_config(EXAMPLES / model)
        config.name = model + DB_SUFFIX
        config.dynamic_batching.SetInParent()
        if delay_us:
            config.dynamic_batching.max_queue_delay_microseconds = delay_us
        (batched / "config.pbtxt").write_text(text_format.MessageToString(config))
    return dest


@contextmanager
def triton(repo: Path, log_path: Path, commands: dict[str, list[str]], name: str) -> Iterator[dict[str, str]]:
    """The real tritonserver on ``repo``; yields host:port of its HTTP and gRPC endpoints."""
    port, grpc_port = reference.free_port(), reference.free_port()
    process = reference.start_reference_triton(repo, port, grpc_port, reference.free_port(), log_path)
    commands[name] = [str(a) for a in process.args]  # type: ignore[union-attr]
    try:
        reference.wait_ready(f"http://127.0.0.1:{port}", 120, process=process, log_path=log_path)
        yield {"http": f"127.0.0.1:{port}", "grpc": f"127.0.0.1:{grpc_port}"}
    finally:
        reference.stop_process(process)


def start_servers(stack: ExitStack, models: list[str], tmp: Path, commands: dict[str, list[str]]) -> list[Endpoint]:
    """geserve and both Triton variants, all started once; only one is ever driven at a time."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    server = stack.enter_context(
        geserve([model_repository(models, tmp / "geserve")], RESULTS / "harness.geserve.log")
    )
    commands["geserve"] = [str(a) for a in server.process.args]  # type: ignore[union-attr]
    os.environ[reference.ORT_THREADS_ENV] = str(threads_per_instance(1))  # the same threads as geserve
    served = {"http": f"127.0.0.1:{server.http_port}", "grpc": f"127.0.0.1:{server.grpc_port}"}
    urls = {"geserve": served, "geserve_db": served}
    for system, batching in (("triton", False), ("triton_db", True)):
        repo = reference.build_python_backend_repository(EXAMPLES, tmp / system, models, dynamic_batching=batching)
        urls[system] = stack.enter_context(triton(repo, RESULTS / f"harness.{system}.log", commands, system))
    return endpoints(urls)


def endpoints(urls: dict[str, dict[str, str]]) -> list[Endpoint]:
    return [
        Endpoint(system, protocol, urls[system][protocol], urls[system]["http"],
                 DB_SUFFIX if system == "geserve_db" else "")
        for system in SYSTEMS for protocol in PROTOCOLS
        if protocol in urls[system] and (protocol == "http" or not system.endswith("_db"))  # gRPC: one each
    ]


def warm_up(endpoint: Endpoint, model: str, config: model_config_pb2.ModelConfig) -> None:
    """A few sequential requests so first-call costs (ONNX Runtime warm-up) stay out of the windows."""
    client = httpclient.InferenceServerClient(endpoint.http_url or endpoint.url)
    model += endpoint.model_suffix
    try:
        inputs = []
        for name, value in random_inputs(config, 1).items():
            tensor = httpclient.InferInput(name, list(value.shape), httpclient.np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        for _ in range(5):
            client.infer(model, inputs)
    finally:
        client.close()


# -------------------------------------------------------------------------------------------- run


def window_ms(mode: Mode, raw_p50_us: float) -> int:
    """Long enough for ``requests_per_window`` sequential requests, and for several c=16 requests, of a slow model."""
    return int(max(mode.window_ms, raw_p50_us / 1000 * max(mode.requests_per_window * 1.2, 2 * max(CONCURRENCIES))))


def guarded(measure: Callable[[], T], label: str, mode: Mode, samples: Samples) -> T:
    """Run ``measure``; when other processes used the CPUs meanwhile, wait for quiet (within the run's
    budget) and run it again."""
    with others_share() as share:
        result = measure()
    if share[0] > BUSY_LIMIT:
        print(f"  {label}: other processes used {share[0]:.0%} of the CPUs", flush=True)
        started = time.monotonic()
        quiet = samples.quiet_budget_s > 0 and wait_for_quiet(min(20.0, samples.quiet_budget_s))
        samples.quiet_budget_s -= time.monotonic() - started
        if quiet:
            with others_share() as share:
                result = measure()
    samples.others.setdefault(label, []).append(share[0])
    return result


def run_round(round_index: int, models: list[str], eps: list[Endpoint], mode: Mode, samples: Samples) -> None:
    """One round: each model's raw measurement, then every endpoint (in a rotated order) at each concurrency."""
    order = eps[round_index % len(eps):] + eps[: round_index % len(eps)]
    for model in models:
        raw = guarded(partial(in_child, raw_onnxruntime, EXAMPLES / model, mode.raw_budget_s), f"{model} raw", mode,
                      samples)
        samples.raw.setdefault(model, []).append(raw)
        print(f"  {model} raw: p50 {raw.p50_us:.0f} µs, best {max(raw.throughput.values()):.0f} rows/s", flush=True)
        window = window_ms(mode, raw.p50_us)
        for endpoint in order:
            for c in CONCURRENCIES:
                label = f"{model} {endpoint.key} c={c}"
                run = partial(perf_analyzer, endpoint, model, c, window, mode, samples)
                point = guarded(run, label, mode, samples)
                if point is not None:
                    samples.served.setdefault(model, {}).setdefault(endpoint.key, {}).setdefault(c, []).append(point)
                    print(f"  {label}: {point.throughput:.0f}/s p50 {point.p50_us:.0f} µs", flush=True)


def median_point(points: list[Point]) -> Point | None:
    if not points:
        return None
    return Point(*(statistics.median(getattr(p, f) for p in points) for f in ("throughput", "p50_us", "p99_us")))


@dataclass
class Summary:
    """Medians per cell: raw b=1 latency/throughput, raw best batch, served points."""

    raw_b1: dict[str, Point]
    raw_best: dict[str, tuple[int, float]]
    served: dict[str, dict[str, dict[int, Point]]]


def summarize(samples: Samples) -> Summary:
    raw_b1, raw_best = {}, {}
    for model, results in samples.raw.items():
        raw_b1[model] = Point(statistics.median(r.throughput[1] for r in results),
                              statistics.median(r.p50_us for r in results),
                              statistics.median(r.p99_us for r in results))
        per_batch = {b: statistics.median(r.throughput[b] for r in results) for b in results[0].throughput}
        best = max(per_batch, key=per_batch.__getitem__)
        raw_best[model] = (best, per_batch[best])
    served = {model: {key: {c: p for c, pts in cells.items() if (p := median_point(pts))}
                      for key, cells in by_key.items()}
              for model, by_key in samples.served.items()}
    return Summary(raw_b1, raw_best, served)


def served_point(summary: Summary, model: str, system: str, concurrency: int, protocol: str = "http") -> Point | None:
    return summary.served.get(model, {}).get(f"{system}/{protocol}", {}).get(concurrency)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


# ---------------------------------------------------------------------------------------- reports


def others_cell(samples: Samples, label: str) -> str:
    """The largest share of the CPUs other processes used while this cell was measured, over the rounds."""
    shares = samples.others.get(label)
    return f"{max(shares):.0%}" if shares else "-"


def measurement_table(summary: Summary, samples: Samples, models: list[str]) -> list[str]:
    lines = ["| model | system | load | infer/s | p50 µs | p99 µs | others' CPU |", "|---|---|---|---:|---:|---:|---:|"]
    for model in models:
        b1, (best, best_tput) = summary.raw_b1[model], summary.raw_best[model]
        raw_others = others_cell(samples, f"{model} raw")
        lines.append(f"| {model} | raw ONNX Runtime | b=1 | {b1.throughput:.0f} | {b1.p50_us:.0f} | {b1.p99_us:.0f} "
                     f"| {raw_others} |")
        lines.append(f"| {model} | raw ONNX Runtime | best b={best} | {best_tput:.0f} | - | - | {raw_others} |")
        for key in summary.served.get(model, {}):
            system, protocol = key.split("/")
            for c, p in sorted(summary.served[model][key].items()):
                lines.append(f"| {model} | {SYSTEMS[system]} ({protocol}) | c={c} | {p.throughput:.0f} "
                             f"| {p.p50_us:.0f} | {p.p99_us:.0f} | {others_cell(samples, f'{model} {key} c={c}')} |")
    return lines


def ratio_table(summary: Summary, models: list[str]) -> list[str]:
    lines = [
        "| model | c | geserve infer/s | ÷ raw | ÷ Triton | ÷ Triton+DB | geserve p50 - raw b=1 p50 µs "
        "| p50 ÷ Triton | p50 ÷ Triton+DB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in models:
        for c in CONCURRENCIES:
            g = served_point(summary, model, "geserve", c)
            if g is None:
                continue
            t, d = served_point(summary, model, "triton", c), served_point(summary, model, "triton_db", c)
            raw = summary.raw_b1[model].throughput if c == 1 else summary.raw_best[model][1]
            lines.append(
                f"| {model} | {c} | {g.throughput:.0f} | {ratio(g.throughput, raw)} "
                f"| {ratio(g.throughput, t and t.throughput)} | {ratio(g.throughput, d and d.throughput)} "
                f"| {g.p50_us - summary.raw_b1[model].p50_us:+.0f} "
                f"| {ratio(g.p50_us, t and t.p50_us)} | {ratio(g.p50_us, d and d.p50_us)} |"
            )
    return lines


def check_targets(summary: Summary, models: list[str]) -> list[tuple[str, bool | None, str]]:
    """The issues' targets: (description, passed or None when not measured, the numbers)."""
    targets: list[tuple[str, bool | None, str]] = []
    if "mlp" in models:
        g1 = served_point(summary, "mlp", "geserve", 1)
        raw = summary.raw_b1["mlp"].p50_us
        delta = g1.p50_us - raw if g1 else None
        targets.append(("MLP p50 at c=1 within 300 µs of raw ONNX Runtime batch-1 p50",
                        None if delta is None else delta <= 300,
                        f"geserve {g1.p50_us:.0f} µs - raw {raw:.0f} µs = {delta:+.0f} µs" if g1 else "not measured"))
        g16 = served_point(summary, "mlp", "geserve", 16)
        for system in ("triton", "triton_db"):
            t16 = served_point(summary, "mlp", system, 16)
            ok = g16.throughput >= 2 * t16.throughput if g16 and t16 else None
            detail = f"{g16.throughput:.0f} vs {t16.throughput:.0f} infer/s = {ratio(g16.throughput, t16.throughput)}" \
                if g16 and t16 else "not measured"
            targets.append((f"MLP throughput at c=16 at least 2x {SYSTEMS[system]}", ok, detail))
    targets += batching_targets(summary, models) + grpc_targets(summary, models)
    if "resnet50" in models:
        g16 = served_point(summary, "resnet50", "geserve", 16)
        best, best_tput = summary.raw_best["resnet50"]
        targets.append(("ResNet-50 throughput at c=16 at least 0.97x raw ONNX Runtime at its best batch size",
                        g16.throughput >= 0.97 * best_tput if g16 else None,
                        f"{g16.throughput:.1f} vs {best_tput:.1f} (b={best}) = {ratio(g16.throughput, best_tput)}"
                        if g16 else "not measured"))
    return targets


def _target(description: str, value: float | None, bound: float, detail: str) -> tuple[str, bool | None, str]:
    return description, None if value is None else value >= bound, detail if value is not None else "not measured"


def batching_targets(summary: Summary, models: list[str]) -> list[tuple[str, bool | None, str]]:
    """Issue 4: what dynamic batching must buy."""
    targets = []
    if "mlp" in models:
        db, plain = served_point(summary, "mlp", "geserve_db", 16), served_point(summary, "mlp", "geserve", 16)
        tdb = served_point(summary, "mlp", "triton_db", 16)
        value = db.throughput / plain.throughput if db and plain else None
        targets.append(_target("MLP c=16: geserve with dynamic batching at least 1.5x without", value, 1.5,
                               f"{ratio(db and db.throughput, plain and plain.throughput)}"))
        value = db.throughput / tdb.throughput if db and tdb else None
        targets.append(_target("MLP c=16: geserve with dynamic batching at least 2x Triton with it", value, 2.0,
                               f"{ratio(db and db.throughput, tdb and tdb.throughput)}"))
        db1, plain1 = served_point(summary, "mlp", "geserve_db", 1), served_point(summary, "mlp", "geserve", 1)
        value = (plain1.p50_us + 20) / db1.p50_us if db1 and plain1 else None
        targets.append(_target("MLP c=1, delay 0: no added latency from the batcher (within 20 µs)", value, 1.0,
                               f"p50 {db1 and db1.p50_us:.0f} vs {plain1 and plain1.p50_us:.0f} µs" if db1 else ""))
    for model in ("resnet50", "efficientnet_lite0"):
        if model in models:
            db = served_point(summary, model, "geserve_db", 16)
            best, best_tput = summary.raw_best[model]
            value = db.throughput / best_tput if db else None
            targets.append(_target(f"{model} c=16 with dynamic batching at least 0.95x raw at its best batch",
                                   value, 0.95, f"{ratio(db and db.throughput, best_tput)} (raw best b={best})"))
    return targets


def grpc_targets(summary: Summary, models: list[str]) -> list[tuple[str, bool | None, str]]:
    """Issue 5: gRPC as fast as Triton's, and within 25% of geserve's own HTTP."""
    if "mlp" not in models:
        return []
    g, t = served_point(summary, "mlp", "geserve", 16, "grpc"), served_point(summary, "mlp", "triton", 16, "grpc")
    h = served_point(summary, "mlp", "geserve", 16)
    return [
        _target("MLP c=16 gRPC: geserve at least Triton", g.throughput / t.throughput if g and t else None, 1.0,
                ratio(g and g.throughput, t and t.throughput)),
        _target("MLP c=16 gRPC within 25% of geserve HTTP", g.throughput / h.throughput if g and h else None, 0.75,
                ratio(g and g.throughput, h and h.throughput)),
    ]


def target_lines(targets: list[tuple[str, bool | None, str]]) -> list[str]:
    verdict = {True: "PASS", False: "FAIL", None: "SKIP"}
    return [f"- **{verdict[ok]}** {text}: {detail}" for text, ok, detail in targets]


def versions() -> dict[str, str]:
    found = {"geserve": geserve_version, "onnxruntime": ort.__version__,
             "perf_analyzer": f"from tritonclient {metadata.version('tritonclient')}",
             "python": platform.python_version()}
    found["onnxruntime (Triton's Python models)"] = subprocess.run(
        [str(reference.REF_VENV / "bin" / "python"), "-c", "import onnxruntime; print(onnxruntime.__version__)"],
        capture_output=True, text=True, check=False).stdout.strip()
    return found


def triton_version(endpoint: Endpoint) -> str:
    with urllib.request.urlopen(f"http://{endpoint.http_url or endpoint.url}/v2", timeout=5) as response:
        return str(json.load(response).get("version", "?"))


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {cpu}, {platform.machine()}"


def write_reports(summary: Summary, samples: Samples, models: list[str], mode: Mode, meta: dict[str, object],
                  targets: list[tuple[str, bool | None, str]]) -> str:
    tables = "\n".join(measurement_table(summary, samples, models)) + "\n\n" + "\n".join(ratio_table(summary, models))
    busy = [label for label, shares in samples.others.items() if max(shares) > BUSY_LIMIT]
    text = (
        "# geserve vs raw ONNX Runtime vs Triton (harness)\n\n"
        f"{meta['date']}, {mode.rounds} alternating round(s), medians shown; {meta['machine']}.\n"
        f"Run time {meta['seconds']:.0f} s: `{meta['command']}`\n\n"
        f"{tables}\n\n"
        "÷ raw: against raw batch-1 rows/s at c=1, against the best batch size at c=4 and c=16. "
        "Triton+DB: Triton with `dynamic_batching {}`.\n\n"
        "## Targets (issues 3, 4 and 5)\n\n" + "\n".join(target_lines(targets)) + "\n\n"
        "## Versions\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta["versions"].items()) + "\n\n"  # type: ignore[union-attr]
        "## How it was measured\n\n"
        f"- raw: in a child process, one ONNX Runtime session with geserve's options "
        f"({threads_per_instance(1)} intra-op threads, 1 inter-op, sequential, ORT_ENABLE_ALL); "
        f"{mode.raw_budget_s} s of timed `session.run` calls per batch size {BATCH_SIZES} (up to max_batch_size).\n"
        "- served: perf_analyzer over HTTP with binary tensors, one run per concurrency, "
        f"`--stability-percentage {mode.stability}` (retried at 100 when it never settled: "
        f"{', '.join(samples.loose) or 'none'}). All servers run for the whole harness; only one is driven at a "
        "time, in an order rotated each round.\n"
        f"- others' CPU: the share of the machine's CPUs that processes outside the harness used during the "
        f"measurement (largest over the rounds). Above {BUSY_LIMIT:.0%}, the harness waits for quiet and measures "
        f"again (within a {mode.quiet_wait_s:.0f} s budget); still disturbed: {', '.join(busy) or 'none'}.\n\n"
        "## Commands\n\n```\n"
        + "\n".join(f"# {name}\n{' '.join(cmd)}" for name, cmd in samples.commands.items())
        + "\n```\n"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "harness.md").write_text(text)
    (RESULTS / "harness.json").write_text(json.dumps({
        "meta": meta, "mode": asdict(mode),
        "summary": {"raw_b1": {m: asdict(p) for m, p in summary.raw_b1.items()},
                    "raw_best": {m: {"batch": b, "throughput": t} for m, (b, t) in summary.raw_best.items()},
                    "served": {m: {k: {str(c): asdict(p) for c, p in cells.items()} for k, cells in by_key.items()}
                               for m, by_key in summary.served.items()}},
        "targets": [{"target": t, "passed": ok, "detail": d} for t, ok, d in targets],
        "samples": {"raw": {m: [asdict(r) for r in rs] for m, rs in samples.raw.items()},
                    "served": {m: {k: {str(c): [asdict(p) for p in pts] for c, pts in cells.items()}
                                   for k, cells in by_key.items()} for m, by_key in samples.served.items()},
                    "others_cpu_share": samples.others, "loose": samples.loose},
        "commands": samples.commands,
    }, indent=1))
    return tables


def plot(summary: Summary, models: list[str]) -> Path:
    """Latency-throughput curves, one panel per model, one line per system, points at each concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for key, cells in summary.served.get(model, {}).items():
            system, protocol = key.split("/")
            points = sorted(cells.items())
            ax.plot([p.throughput for _, p in points], [p.p50_us / 1000 for _, p in points], marker="o",
                    label=f"{SYSTEMS[system]} ({protocol})")
            for c, p in points:
                ax.annotate(f"c={c}", (p.throughput, p.p50_us / 1000), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        b1, (best, best_tput) = summary.raw_b1[model], summary.raw_best[model]
        ax.plot([b1.throughput], [b1.p50_us / 1000], marker="*", markersize=12, linestyle="", color="black",
                label="raw ONNX Runtime b=1")
        ax.axvline(best_tput, color="gray", linestyle=":", label=f"raw ONNX Runtime best (b={best})")
        ax.set(title=model, xlabel="throughput (infer/s)", ylabel="p50 latency (ms)", xscale="log", yscale="log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = RESULTS / "harness.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------- main


def ensure_installed(models: list[str]) -> None:
    """perf_analyzer and tritonserver (scripts/install_reference.sh), and the example models."""
    if not reference.perf_analyzer_path().is_file() or not reference.reference_available():
        subprocess.run(["bash", str(ROOT / "scripts" / "install_reference.sh")], check=True)
    only = [arg for model in models for arg in ("--only", model)]
    subprocess.run([sys.executable, str(ROOT / "examples" / "build.py"), *only], check=True, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, short windows (a few minutes)")
    parser.add_argument("--models", default="mlp,resnet50", help="comma-separated (mlp, resnet50, digits, "
                        "efficientnet_lite0)")
    parser.add_argument("--rounds", type=int, help="override the number of alternating rounds")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if args.rounds:
        mode = Mode(**{**asdict(mode), "rounds": args.rounds})
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    started = time.monotonic()
    ensure_installed(models)
    configs = {model: load_config(EXAMPLES / model) for model in models}
    for config in configs.values():
        random_inputs(config, 1)  # fail early on models with variable dims
    samples = Samples(quiet_budget_s=mode.quiet_wait_s)
    with tempfile.TemporaryDirectory(prefix="harness-") as tmp, ExitStack() as stack:
        eps = start_servers(stack, models, Path(tmp), samples.commands)
        for endpoint in eps:
            for model in models:
                warm_up(endpoint, model, configs[model])
        triton_ver = triton_version(next(e for e in eps if e.system == "triton"))
        for round_index in range(mode.rounds):
            print(f"round {round_index + 1}/{mode.rounds}", flush=True)
            run_round(round_index, models, eps, mode, samples)
    summary = summarize(samples)
    targets = check_targets(summary, models)
    meta: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
        "command": " ".join([".venv/bin/python", "bench/harness.py", *sys.argv[1:]]),
        "versions": {**versions(), "Triton": triton_ver}, "seconds": time.monotonic() - started,
    }
    tables = write_reports(summary, samples, models, mode, meta, targets)
    png = plot(summary, models)
    print(tables)
    print("\n".join(target_lines(targets)))
    print(f"written to {(RESULTS / 'harness.md').relative_to(ROOT)}, harness.json, {png.name} "
          f"in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
