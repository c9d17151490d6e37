"""Issue 15's targets: geserve with `--workers` against the real Triton, its own baseline and raw ONNX Runtime.

Every server is started once per configuration and kept for the whole run; in each round every section drives its
systems one at a time with perf_analyzer (harness.py's settings and its wait for a quiet machine), in an order
rotated each round, and the report gives medians over the rounds and the median of the per-round ratios (the two
sides of a ratio are measured minutes apart, so machine noise hits both alike). Sections (`--only`):

- http: MLP c=16 over HTTP, geserve with `--workers` auto (one per core) vs Triton 2.51 (Python-backend models
  running the same ONNX Runtime session), both without batching and both with
  `dynamic_batching { max_queue_delay_microseconds: 2000 }` (each server on its own repository copy), and geserve
  with batching and its early dispatch turned off (`early_batch_dispatch: "false"`: Triton's wait for the delay);
- grpc: MLP c=16 over gRPC: geserve unary and streaming (`--streaming`), Triton unary;
- cpu: server CPU per inference over HTTP (from /proc: the whole process tree, i.e. geserve's supervisor and
  workers, tritonserver and its python-backend stubs), from the http section's runs; also perf_analyzer's own
  CPU (this process's reaped-children rusage around each run) and how many cores each took;
- c1: MLP c=1 p50 over HTTP, geserve `--workers 1` from the working tree vs `--baseline` (default 38a0d2e, the last
  commit before workers) served from a temporary git worktree as ab_compare.py does;
- ab: MLP c=16, the working tree against `--baseline` (from a temporary worktree as for c1, with its workers),
  both with `--workers` auto and started with only options both understand, both serving one repository copy:
  HTTP without and with `dynamic_batching { max_queue_delay_microseconds: 2000 }`, gRPC unary and streaming; a
  cell's two systems run back to back, the first alternating each round; target: every cell's throughput within
  5% of the baseline's;
- resnet: ResNet-50 with `dynamic_batching {}` at c=16 (geserve, `--resnet-workers`, default auto) vs raw ONNX
  Runtime in a child process at its best batch size (picked by a sweep, then measured again after geserve's cell);
- scaling: MLP c=16 HTTP throughput with `--workers` 1 and 2 (`--workers-list 1,2,4,8,16` on bigger machines);
- lean: the same MLP cells on bench/lean_server.py (as many processes as geserve's workers), the least Python a
  KServe binary inference can cost: no target, a yardstick for what a Python front door could reach here. Its
  ratios to Triton and to geserve are listed when the http section ran in the same rounds.

Every served cell records the server tree's CPU and perf_analyzer's CPU, so every row shows both. Writes
bench/results/workers.md and workers.json (server logs: workers.*.log, git-ignored) and prints PASS/FAIL lines.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ab_compare  # noqa: E402
import harness  # noqa: E402
from google.protobuf import text_format  # noqa: E402
from harness import Endpoint, Mode, Samples  # noqa: E402

from geserve.devices import threads_per_instance  # noqa: E402
from geserve.tune.machine import tree_cpu_s, tree_size  # noqa: E402
from geserve.workers.supervisor import worker_count  # noqa: E402
from tests.support import reference  # noqa: E402
from tests.support.server import start_geserve, stop_geserve  # noqa: E402

SECTIONS = ("http", "grpc", "cpu", "c1", "ab", "resnet", "scaling", "lean")
DEFAULT_BASELINE = "38a0d2e"  # the last commit before `--workers` (issue 15)
QUEUE_DELAY_US = 2000
RAW_CHECK_S = 6.0  # seconds of ResNet-50's raw best batch measured again (about a perf_analyzer cell's length)
WINDOW_CAP = 4  # ResNet-50's perf_analyzer window: at most this many times the mode's
UNSETTLED = 1000  # perf_analyzer --stability-percentage that accepts any windows
C1_NOISE = 1.10  # c=1 p50 "no worse than the baseline": within 10%, this VM's run-to-run noise at the least
AB_FLOOR = 0.95  # ab: the working tree's throughput at least this share of the baseline's in every cell
AB_CELLS = (  # what, protocol, streaming, the servers' suffix
    ("HTTP c=16", "http", False, ""), (f"HTTP c=16 + DB ({QUEUE_DELAY_US} µs)", "http", False, "_db"),
    ("gRPC c=16 unary", "grpc", False, ""), ("gRPC c=16 streaming", "grpc", True, ""))


# ------------------------------------------------------------------------------------------ servers


@dataclass
class Server:
    """One running server: how to reach it and the root of its process tree."""

    name: str
    label: str
    pid: int
    http: str  # host:port
    grpc: str
    workers: int  # geserve processes serving the ports (Triton: 1)
    stop: Callable[[], object]


@dataclass(frozen=True)
class Cell:
    """One measured point: a server, a model, a protocol and a concurrency."""

    section: str
    key: str
    server: str
    model: str
    protocol: str = "http"
    concurrency: int = 16
    streaming: bool = False


@dataclass
class Sample:
    throughput: float
    p50_us: float
    p99_us: float
    inferences: int  # the server's successful inferences during the perf_analyzer run (its statistics)
    server_cpu_s: float  # the server's whole process tree
    pa_cpu_s: float  # perf_analyzer itself
    wall_s: float  # the perf_analyzer run, start to exit

    @property
    def server_cpu_us(self) -> float | None:
        return self.server_cpu_s / self.inferences * 1e6 if self.inferences else None

    @property
    def pa_cpu_us(self) -> float | None:
        return self.pa_cpu_s / self.inferences * 1e6 if self.inferences else None

    @property
    def server_cores(self) -> float:
        return self.server_cpu_s / self.wall_s

    @property
    def pa_cores(self) -> float:
        return self.pa_cpu_s / self.wall_s


def config_with(model_dir: Path, delay_us: int | None, early: bool = True) -> str:
    """``model_dir``'s config.pbtxt with ``dynamic_batching`` added (a queue delay when ``delay_us`` is given;
    geserve's early dispatch turned off when not ``early``)."""
    config = harness.load_config(model_dir)
    config.dynamic_batching.SetInParent()
    if delay_us is not None:
        config.dynamic_batching.max_queue_delay_microseconds = delay_us
    if not early:
        config.parameters["early_batch_dispatch"].string_value = "false"
    return str(text_format.MessageToString(config))


def geserve_repo(model: str, dest: Path, batching: bool, delay_us: int | None = None, early: bool = True) -> Path:
    """A repository of ``model`` alone: a link to the example, or a copy of links whose config adds batching."""
    dest.mkdir(parents=True)
    source = harness.EXAMPLES / model
    if not batching:
        (dest / model).symlink_to(source, target_is_directory=True)
        return dest
    (dest / model).mkdir()
    for item in source.iterdir():
        if item.name not in ("config.pbtxt", ".stamp"):
            (dest / model / item.name).symlink_to(item, target_is_directory=item.is_dir())
    (dest / model / "config.pbtxt").write_text(config_with(source, delay_us, early))
    return dest


def triton_repo(model: str, dest: Path, batching: bool) -> Path:
    """tests/support/reference.py's Python-backend model, with the same queue delay as geserve's when batching."""
    repo = reference.build_python_backend_repository(harness.EXAMPLES, dest, [model], dynamic_batching=batching)
    if batching:
        (repo / model / "config.pbtxt").write_text(config_with(repo / model, QUEUE_DELAY_US))
    return repo


def wait_ready(http: str, timeout_s: float = 180) -> None:
    """Until /v2/health/ready answers 200: for geserve's supervisor, every worker has loaded its models."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{http} not ready within {timeout_s} s")


def start_geserve_server(name: str, label: str, repo: Path, workers: int) -> Server:
    """The working tree's `geserve serve --workers N` (0: the default, one per core)."""
    running = start_geserve([repo], harness.RESULTS / f"workers.{name}.log", ["--workers", str(workers)])
    server = Server(name, label, running.process.pid, f"127.0.0.1:{running.http_port}",
                    f"127.0.0.1:{running.grpc_port}", worker_count(workers), partial(stop_geserve, running))
    try:
        wait_ready(server.http)
    except Exception:
        server.stop()
        raise
    return server


def start_triton(name: str, label: str, repo: Path) -> Server:
    port, grpc_port = reference.free_port(), reference.free_port()
    log = harness.RESULTS / f"workers.{name}.log"
    process = reference.start_reference_triton(repo, port, grpc_port, reference.free_port(), log)
    try:
        reference.wait_ready(f"http://127.0.0.1:{port}", 120, process=process, log_path=log)
    except Exception:
        reference.stop_process(process)
        raise
    return Server(name, label, process.pid, f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", 1,
                  partial(reference.stop_process, process))


def start_lean(name: str, label: str, batching: bool) -> Server:
    """bench/lean_server.py on the MLP, one process per geserve worker (auto), in a session of its own."""
    port = reference.free_port()
    model = harness.onnx_path(harness.EXAMPLES / "mlp", harness.load_config(harness.EXAMPLES / "mlp"))
    command = [sys.executable, str(ROOT / "bench" / "lean_server.py"), str(model), "--name", "mlp", "--port",
               str(port), "--workers", str(worker_count(0)),
               "--max-queue-delay-us", str(QUEUE_DELAY_US if batching else 0)]
    with open(harness.RESULTS / f"workers.{name}.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(name, label, process.pid, f"127.0.0.1:{port}", "", worker_count(0),
                    partial(reference.stop_process, process))  # its forked workers are in its process group
    try:
        wait_ready(server.http, 60)
    except Exception:
        server.stop()
        raise
    return server


@contextmanager
def baseline_server(ref: str, repo: Path, name: str = "baseline", label: str = "", workers: int = 1) -> Iterator[
        Server]:
    """geserve at ``ref`` from a temporary git worktree (ab_compare.py's way, no option but ports and repository),
    with GESERVE_WORKERS=``workers`` (0: one per core) for a baseline that has workers (older ones ignore it)."""
    with ExitStack() as stack:
        tree = stack.enter_context(ab_compare.worktree(ref))
        with environment(GESERVE_WORKERS=str(workers)):
            running = stack.enter_context(ab_compare.serve(tree, repo, harness.RESULTS / f"workers.{name}.log"))
        server = Server(name, label or f"geserve {ref} (one process)", running.process.pid,
                        f"127.0.0.1:{running.http_port}", f"127.0.0.1:{running.grpc_port}", worker_count(workers),
                        lambda: None)
        wait_ready(server.http)
        yield server


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """``values`` in os.environ while a server starts (it copies the environment), then as they were."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def warm_up(server: Server, model: str) -> None:
    """A few requests on several connections, so that every worker (the supervisor spreads connections) has run
    the model before the first window."""
    config = harness.load_config(harness.EXAMPLES / model)
    for _ in range(4 * server.workers):
        harness.warm_up(Endpoint(server.name, "http", server.http, server.http), model, config)


# --------------------------------------------------------------------------------------- measuring


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def perf_analyzer(cell: Cell, server: Server, window_ms: int, mode: Mode, samples: Samples) -> Sample | None:
    """One perf_analyzer run (harness.py's; retried at stability 100% and 3x the window when it never settles, and
    then at UNSETTLED),
    with the server tree's and perf_analyzer's CPU and the server's inference count around it."""
    url = server.grpc if cell.protocol == "grpc" else server.http
    endpoint = Endpoint(server.name, cell.protocol, url, server.http)
    output = ""
    # A shared machine can keep a cell from ever settling; the last try takes any three windows, listed as loose.
    for stability, window in ((mode.stability, window_ms), (100, 3 * window_ms), (UNSETTLED, 3 * window_ms)):
        with tempfile.TemporaryDirectory(prefix="workers-pa-") as tmp:
            csv_path = Path(tmp) / "pa.csv"
            args = harness.perf_analyzer_args(endpoint, cell.model, cell.concurrency, window, stability, mode,
                                              csv_path)
            if cell.streaming:
                args.insert(-2, "--streaming")
            count0, tree0, pa0, wall0 = (harness.served_count(server.http, cell.model), tree_cpu_s(server.pid),
                                         children_cpu_s(), time.monotonic())
            result = reference.run_perf_analyzer(args, timeout=60 + mode.max_trials * window / 1000 * 2)
            wall, pa, tree = time.monotonic() - wall0, children_cpu_s() - pa0, tree_cpu_s(server.pid) - tree0
            count = harness.served_count(server.http, cell.model) - count0
            point = harness.read_csv_point(csv_path)
            output = result.stdout + result.stderr
        samples.commands[cell.key] = ["perf_analyzer", *args[:-2]]
        if point is not None:
            if stability >= 100:
                samples.loose.append(cell.key if stability == 100 else f"{cell.key} (unsettled)")
            return Sample(point.throughput, point.p50_us, point.p99_us, count, tree, pa, wall)
    print(f"  {cell.key}: perf_analyzer gave no result: {output[-800:]}", file=sys.stderr)
    return None


# ------------------------------------------------------------------------------------------- plan


def plan(sections: list[str], workers_list: list[int]) -> list[Cell]:
    """The cells of the chosen sections (cpu reads the http section's runs; scaling reuses servers by count)."""
    auto = worker_count(0)
    cells: list[Cell] = []
    if "http" in sections or "cpu" in sections:
        cells += [Cell("http", "MLP HTTP c=16 geserve", "g_auto", "mlp"),
                  Cell("http", "MLP HTTP c=16 Triton", "triton", "mlp"),
                  Cell("http", "MLP HTTP c=16 geserve + DB", "g_auto_db", "mlp"),
                  Cell("http", "MLP HTTP c=16 Triton + DB", "triton_db", "mlp"),
                  Cell("http", "MLP HTTP c=16 geserve + DB, early dispatch off", "g_auto_db_late", "mlp")]
    if "grpc" in sections:
        cells += [Cell("grpc", "MLP gRPC c=16 geserve unary", "g_auto", "mlp", "grpc"),
                  Cell("grpc", "MLP gRPC c=16 geserve streaming", "g_auto", "mlp", "grpc", streaming=True),
                  Cell("grpc", "MLP gRPC c=16 Triton unary", "triton", "mlp", "grpc")]
    if "c1" in sections:
        cells += [Cell("c1", "MLP HTTP c=1 geserve --workers 1", "g_1", "mlp", concurrency=1),
                  Cell("c1", "MLP HTTP c=1 baseline", "baseline", "mlp", concurrency=1)]
    if "ab" in sections:  # pairs: baseline, new
        cells += [Cell("ab", f"MLP {what} {side}", f"ab_{side}{db}", "mlp", protocol, streaming=streaming)
                  for what, protocol, streaming, db in AB_CELLS for side in ("baseline", "new")]
    if "resnet" in sections:
        cells += [Cell("resnet", "ResNet-50 HTTP c=16 geserve + DB", "g_resnet", "resnet50")]
    if "lean" in sections:
        cells += [Cell("lean", "MLP HTTP c=16 lean Python server", "lean", "mlp"),
                  Cell("lean", "MLP HTTP c=16 lean Python server + DB", "lean_db", "mlp")]
    if "scaling" in sections:
        cells += [Cell("scaling", f"MLP HTTP c=16 geserve --workers {n}", "g_auto" if n == auto else f"g_{n}", "mlp")
                  for n in workers_list]
    return cells


def start_servers(stack: ExitStack, cells: list[Cell], tmp: Path, baseline: str, resnet_workers: int) -> dict[
        str, Server]:
    """Every server the cells name, started once (one after the other: start-up is CPU-bound here)."""
    servers: dict[str, Server] = {}
    for name in dict.fromkeys(cell.server for cell in cells):
        print(f"starting {name}", file=sys.stderr, flush=True)
        if name == "baseline":
            server = stack.enter_context(baseline_server(baseline, geserve_repo("mlp", tmp / name, False)))
        elif name.startswith("lean"):
            batching = name.endswith("_db")
            server = start_lean(name, f"lean_server.py --workers {worker_count(0)}{' + DB' if batching else ''}",
                                batching)
            stack.callback(server.stop)
        elif name.startswith("triton"):
            batching = name.endswith("_db")
            server = start_triton(name, f"Triton{' + DB' if batching else ''}",
                                  triton_repo("mlp", tmp / name, batching))
            stack.callback(server.stop)
        elif name.startswith("ab_"):
            batching = name.endswith("_db")
            repo = tmp / ("ab_db" if batching else "ab")  # one copy for both systems
            if not repo.exists():
                geserve_repo("mlp", repo, batching, QUEUE_DELAY_US)
            side = f"--workers {worker_count(0)} (auto){' + DB' if batching else ''}"
            if name.startswith("ab_baseline"):
                server = stack.enter_context(baseline_server(baseline, repo, name, f"geserve {baseline} {side}", 0))
            else:
                server = start_geserve_server(name, f"geserve {commit()} {side}", repo, 0)
                stack.callback(server.stop)
        elif name == "g_resnet":
            repo = geserve_repo("resnet50", tmp / name, True)
            server = start_geserve_server(name, f"geserve --workers {worker_count(resnet_workers)} + DB", repo,
                                          resnet_workers)
            stack.callback(server.stop)
        else:
            batching, early = name.startswith("g_auto_db"), name != "g_auto_db_late"
            count = 0 if name.startswith("g_auto") else int(name.removeprefix("g_"))
            label = f"geserve --workers {worker_count(count)}{' (auto)' if count == 0 else ''}"
            label += (" + DB" if batching else "") + ("" if early else ", early dispatch off")
            server = start_geserve_server(name, label,
                                          geserve_repo("mlp", tmp / name, batching, QUEUE_DELAY_US, early), count)
            stack.callback(server.stop)
        servers[name] = server
        warm_up(server, "resnet50" if name == "g_resnet" else "mlp")
    for server in servers.values():
        print(f"  {server.name}: {server.label}, {tree_size(server.pid)} processes", file=sys.stderr)
    return servers


# -------------------------------------------------------------------------------------------- run


@dataclass
class Results:
    rounds: dict[str, list[Sample | None]] = field(default_factory=dict)  # cell key -> one per round
    raw: list[harness.RawResult] = field(default_factory=list)  # ResNet-50's sweep, one per round
    raw_again: list[float | None] = field(default_factory=list)  # its best batch measured again after the cell
    processes: dict[str, int] = field(default_factory=dict)  # server -> processes in its tree


def run_round(index: int, cells: list[Cell], servers: dict[str, Server], mode: Mode, samples: Samples,
              results: Results) -> None:
    for section in dict.fromkeys(cell.section for cell in cells):
        group = [cell for cell in cells if cell.section == section]
        shift = (2 * index if section == "ab" else index) % len(group)
        order = group[shift:] + group[:shift]
        if section == "ab" and index % 2:  # a cell's two systems back to back, the first alternating
            order = [order[i ^ 1] for i in range(len(order))]
        window = mode.window_ms
        if section == "resnet":
            raw = harness.guarded(partial(harness.in_child, harness.raw_onnxruntime, harness.EXAMPLES / "resnet50",
                                          mode.raw_budget_s),
                                  "resnet50 raw", mode, samples)
            results.raw.append(raw)
            best = max(raw.throughput, key=raw.throughput.__getitem__)
            print(f"  ResNet-50 raw: b=1 p50 {raw.p50_us / 1000:.1f} ms, best b={best} "
                  f"{raw.throughput[best]:.1f} rows/s", flush=True)
            # harness.py's rule (~60 sequential requests), capped: on a crowded machine a ResNet-50 run can take
            # half a second and the windows would run for minutes.
            window = min(harness.window_ms(mode, raw.p50_us), WINDOW_CAP * mode.window_ms)
        for cell in order:
            server = servers[cell.server]
            harness.wait_for_quiet(5)
            sample = harness.guarded(partial(perf_analyzer, cell, server, window, mode, samples), cell.key, mode,
                                     samples)
            results.rounds.setdefault(cell.key, []).append(sample)
            if sample is not None:
                print(f"  {cell.key}: {sample.throughput:.0f}/s p50 {sample.p50_us:.0f} µs, server "
                      f"{sample.server_cpu_us or 0:.0f} µs CPU/inf ({sample.server_cores:.2f} cores), perf_analyzer "
                      f"{sample.pa_cores:.2f} cores", flush=True)
        if section == "resnet":
            # The sweep's best is the largest of six noisy figures, so it reads high (the winner's curse: about 5%
            # on this VM): the yardstick is the best batch measured again, on its own, right after geserve's cell.
            rows = harness.guarded(partial(harness.in_child, harness.raw_rows, harness.EXAMPLES / "resnet50",
                                           best, RAW_CHECK_S), "resnet50 raw best batch", mode, samples)
            results.raw_again.append(rows)
            if rows is not None:
                print(f"  ResNet-50 raw again at b={best}: {rows:.1f} rows/s", flush=True)


# ---------------------------------------------------------------------------------------- summary


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def metric(results: Results, key: str, name: str) -> list[float | None]:
    return [None if s is None else getattr(s, name) for s in results.rounds.get(key, [])]


def paired_ratio(results: Results, a: str, b: str, name: str) -> tuple[float | None, list[float]]:
    """Median over the rounds of a's metric over b's in the same round, and the per-round ratios."""
    ratios = [x / y for x, y in zip(metric(results, a, name), metric(results, b, name), strict=False)
              if x is not None and y]
    return (statistics.median(ratios) if ratios else None), ratios


def raw_best(results: Results) -> tuple[int, float] | None:
    if not results.raw:
        return None
    per_batch = {b: statistics.median(r.throughput[b] for r in results.raw) for b in results.raw[0].throughput}
    best = max(per_batch, key=per_batch.__getitem__)
    return best, per_batch[best]


Target = tuple[str, bool | None, str]


def target(text: str, results: Results, a: str, b: str, name: str, bound: float, at_most: bool = False) -> Target:
    value, each = paired_ratio(results, a, b, name)
    if value is None:
        return text, None, "not measured"
    ok = value <= bound if at_most else value >= bound
    rounds = ", ".join(f"{r:.2f}" for r in each)
    ma, mb = median(metric(results, a, name)), median(metric(results, b, name))
    return text, ok, f"{value:.2f}x (rounds {rounds}; medians {ma or 0:.0f} vs {mb or 0:.0f})"


def targets(results: Results, cells: list[Cell], sections: list[str]) -> list[Target]:
    keys = {(c.section, c.server, c.protocol, c.concurrency, c.streaming): c.key for c in cells}

    def key(section: str, server: str, protocol: str = "http", concurrency: int = 16, streaming: bool = False) -> str:
        return keys[section, server, protocol, concurrency, streaming]

    found: list[Target] = []
    if "http" in sections:
        found += [
            target("MLP HTTP c=16, no batching: geserve (workers auto) >= 2x Triton", results,
                   key("http", "g_auto"), key("http", "triton"), "throughput", 2.0),
            target(f"MLP HTTP c=16, dynamic batching ({QUEUE_DELAY_US} µs): geserve >= 2x Triton", results,
                   key("http", "g_auto_db"), key("http", "triton_db"), "throughput", 2.0),
        ]
    if "grpc" in sections:
        found += [
            target("MLP gRPC c=16 unary: geserve >= 1.2x Triton", results, key("grpc", "g_auto", "grpc"),
                   key("grpc", "triton", "grpc"), "throughput", 1.2),
            target("MLP gRPC c=16: geserve streaming >= geserve unary", results,
                   key("grpc", "g_auto", "grpc", streaming=True), key("grpc", "g_auto", "grpc"), "throughput", 1.0),
        ]
    if "cpu" in sections:  # the http section's runs
        found += [
            target("server CPU per inference, HTTP c=16, no batching: geserve <= 0.5x Triton", results,
                   key("http", "g_auto"), key("http", "triton"), "server_cpu_us", 0.5, at_most=True),
            target("server CPU per inference, HTTP c=16, dynamic batching: geserve <= 0.5x Triton", results,
                   key("http", "g_auto_db"), key("http", "triton_db"), "server_cpu_us", 0.5, at_most=True),
        ]
    if "c1" in sections:
        found.append(target(f"MLP HTTP c=1 p50: geserve --workers 1 no worse than the baseline (ratio <= "
                            f"{C1_NOISE:.2f}, the noise allowance)", results, key("c1", "g_1", concurrency=1),
                            key("c1", "baseline", concurrency=1), "p50_us", C1_NOISE, at_most=True))
    for base, new in ab_pairs(cells):
        found.append(target(f"{new.key.removesuffix(' new')}: the working tree within {1 - AB_FLOOR:.0%} of the "
                            f"baseline (throughput ratio >= {AB_FLOOR:.2f})", results, new.key, base.key,
                            "throughput", AB_FLOOR))
    if "resnet" in sections:
        found.append(resnet_target(results, key("resnet", "g_resnet")))
    return found


def resnet_target(results: Results, cell_key: str) -> Target:
    """geserve's ResNet-50 rows/s over raw ONNX Runtime at its best batch, measured again in the same round."""
    text = "ResNet-50 c=16 with dynamic batching >= 0.95x raw ONNX Runtime at its best batch"
    rounds = [(s.throughput, again, max(sweep.throughput.values()))
              for s, again, sweep in zip(results.rounds.get(cell_key, []), results.raw_again, results.raw, strict=False)
              if s is not None and again]
    if not rounds:
        return text, None, "not measured"
    ratios = [ours / again for ours, again, _ in rounds]
    value = statistics.median(ratios)
    against_sweep = statistics.median(ours / sweep for ours, _, sweep in rounds)
    return (text, value >= 0.95,
            f"{value:.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)}; medians "
            f"{statistics.median(r[0] for r in rounds):.1f} vs {statistics.median(r[1] for r in rounds):.1f} rows/s; "
            f"against the sweep's own best, {against_sweep:.2f}x)")


def target_lines(found: list[Target]) -> list[str]:
    verdict = {True: "PASS", False: "FAIL", None: "SKIP"}
    return [f"{verdict[ok]}: {text}: {detail}" for text, ok, detail in found]


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cell_table(results: Results, cells: list[Cell], servers: dict[str, Server], samples: Samples) -> list[str]:
    lines = ["| cell | server | infer/s | p50 µs | p99 µs | server CPU µs/inf | server cores | perf_analyzer CPU "
             "µs/inf | perf_analyzer cores | others' CPU | rounds (infer/s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for cell in cells:
        if cell.key not in results.rounds:
            continue
        each = ", ".join("-" if s is None else f"{s.throughput:.0f}" for s in results.rounds[cell.key])
        shares = samples.others.get(cell.key)

        def m(name: str, key: str = cell.key) -> float | None:
            return median(metric(results, key, name))

        lines.append(f"| {cell.key} | {servers[cell.server].label} | {fmt(m('throughput'))} | {fmt(m('p50_us'))} "
                     f"| {fmt(m('p99_us'))} | {fmt(m('server_cpu_us'))} | {fmt(m('server_cores'), 2)} "
                     f"| {fmt(m('pa_cpu_us'))} | {fmt(m('pa_cores'), 2)} "
                     f"| {f'{max(shares):.0%}' if shares else '-'} | {each} |")
    return lines


def scaling_table(results: Results, cells: list[Cell], servers: dict[str, Server]) -> list[str]:
    rows = [cell for cell in cells if cell.section == "scaling"]
    if not rows:
        return []
    base = median(metric(results, rows[0].key, "throughput"))
    lines = ["| workers | processes | infer/s | vs first row | p50 µs | server cores | perf_analyzer cores |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for cell in rows:
        server = servers[cell.server]
        tput = median(metric(results, cell.key, "throughput"))
        lines.append(f"| {server.workers} | {results.processes.get(cell.server, '-')} | {fmt(tput)} "
                     f"| {f'{tput / base:.2f}x' if tput and base else '-'} "
                     f"| {fmt(median(metric(results, cell.key, 'p50_us')))} "
                     f"| {fmt(median(metric(results, cell.key, 'server_cores')), 2)} "
                     f"| {fmt(median(metric(results, cell.key, 'pa_cores')), 2)} |")
    return lines


def ab_pairs(cells: list[Cell]) -> list[tuple[Cell, Cell]]:
    ab = [cell for cell in cells if cell.section == "ab"]
    return list(zip(ab[::2], ab[1::2], strict=True))


def ab_rows(results: Results, cells: list[Cell]) -> list[dict[str, Any]]:
    """Each A/B cell: both medians and the median of per-round new/baseline ratios, for throughput and CPU."""
    rows: list[dict[str, Any]] = []
    for base, new in ab_pairs(cells):
        row: dict[str, Any] = {"cell": new.key.removesuffix(" new")}
        for name, short in (("throughput", ""), ("server_cpu_us", "cpu_")):
            ratio, each = paired_ratio(results, new.key, base.key, name)
            row |= {f"{short}baseline": median(metric(results, base.key, name)),
                    f"{short}new": median(metric(results, new.key, name)), f"{short}ratio": ratio,
                    f"{short}rounds": each}
        rows.append(row)
    return rows


def ab_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| cell | baseline infer/s | new infer/s | new / baseline | rounds (new / baseline) | baseline server CPU "
             "µs/inf | new server CPU µs/inf | CPU new / baseline |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['cell']} | {fmt(row['baseline'])} | {fmt(row['new'])} | {fmt(row['ratio'], 2)} "
                     f"| {', '.join(f'{r:.2f}' for r in row['rounds']) or '-'} | {fmt(row['cpu_baseline'])} "
                     f"| {fmt(row['cpu_new'])} | {fmt(row['cpu_ratio'], 2)} |")
    return lines


def lean_lines(results: Results) -> list[str]:
    """The lean server's cells against Triton and geserve measured in the same rounds (the http section's)."""
    lines = []
    for suffix, what in (("", "no batching"), (" + DB", f"dynamic batching ({QUEUE_DELAY_US} µs)")):
        lean = f"MLP HTTP c=16 lean Python server{suffix}"
        if lean not in results.rounds:
            continue
        parts = [f"{fmt(median(metric(results, lean, 'throughput')))} infer/s, server "
                 f"{fmt(median(metric(results, lean, 'server_cpu_us')))} µs CPU/inf"]
        for other in ("Triton", "geserve"):
            value, each = paired_ratio(results, lean, f"MLP HTTP c=16 {other}{suffix}", "throughput")
            if value is not None:
                parts.append(f"{value:.2f}x {other} (rounds {', '.join(f'{r:.2f}' for r in each)})")
        lines.append(f"- {what}: " + "; ".join(parts))
    return lines


def report(results: Results, cells: list[Cell], servers: dict[str, Server], samples: Samples, mode: Mode,
           found: list[Target], meta: dict[str, object]) -> str:
    raw = raw_best(results)
    raw_line = "" if raw is None else (
        f"\nResNet-50 raw ONNX Runtime (child process, geserve's session options): best batch {raw[0]}, "
        f"{raw[1]:.1f} rows/s in the sweep, {median(results.raw_again) or 0:.1f} rows/s measured again on its own "
        f"after geserve's cell (the target's yardstick; medians over rounds).\n")
    pa_cores = median([s.pa_cores for runs in results.rounds.values() for s in runs if s is not None])
    scaling = scaling_table(results, cells, servers)
    lean = lean_lines(results)
    ab = ab_table(ab_rows(results, cells)) if ab_pairs(cells) else []
    return "\n".join([
        "# geserve workers vs Triton (issue 15)",
        "",
        f"{meta['date']}, geserve {meta['commit']} (baseline {meta['baseline']}), {mode.rounds} alternating "
        f"round(s), medians shown; {meta['machine']}. "
        f"Run time {meta['seconds']:.0f} s: `{meta['command']}`",
        "",
        *cell_table(results, cells, servers, samples),
        raw_line,
        *(["## Scaling (MLP HTTP c=16, no batching)", "", *scaling, ""] if scaling else []),
        *([f"## A/B: the working tree ({meta['commit']}) vs {meta['baseline']}, both `--workers` auto (MLP c=16)",
            "", "Medians over the rounds; ratios are medians of per-round ratios (a cell's two systems run back to "
            "back, the first alternating).", "", *ab, ""] if ab else []),
        *(["## The lean Python server (bench/lean_server.py: a yardstick, no target)", "", *lean, ""] if lean else []),
        "## Targets (issue 15)",
        "",
        *(f"- **{line.split(':', 1)[0]}**{line.split(':', 1)[1]}" for line in target_lines(found)),
        "",
        "## How it was measured",
        "",
        "- perf_analyzer (binary tensors, one run per cell, harness.py's windows: "
        f"`--measurement-interval {mode.window_ms}`, for ResNet-50 up to {WINDOW_CAP}x that, `--stability-percentage "
        f"{mode.stability}`, retried at 100 with a 3x window when it never settled, then at {UNSETTLED}: "
        f"{', '.join(samples.loose) or 'none'}). Every server runs for the whole bench; only one is driven at a "
        "time, the order rotated each round.",
        "- Ratios in the targets are the median of per-round ratios (both sides measured in the same round).",
        "- server CPU µs/inf: CPU time of the server's whole process tree (geserve: supervisor and workers; "
        "Triton: tritonserver and its python-backend stubs) over the inferences its statistics counted during "
        "the perf_analyzer run. server cores / perf_analyzer cores: CPU seconds over the run's wall time. "
        f"perf_analyzer took {fmt(pa_cores, 2)} cores (median over every cell) of this machine's "
        f"{len(os.sched_getaffinity(0))}.",
        "- others' CPU: the share of the machine used by processes outside the bench during the cell (largest over "
        "the rounds); above ~15% the numbers are disturbed.",
        f"- Processes per server: {', '.join(f'{n} {p}' for n, p in results.processes.items())}.",
        "",
        "## Commands",
        "",
        "```",
        *(f"# {name}\n{' '.join(command)}" for name, command in samples.commands.items()),
        "```",
        "",
    ])


# ------------------------------------------------------------------------------------------- main


def commit() -> str:
    """HEAD, with "+tree" when the package has uncommitted changes (what the working tree's servers ran)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "geserve")
    return git("rev-parse", "--short", "HEAD") + ("+tree" if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, short windows (under ~5 minutes)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3; --quick: 1)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit c1 and ab compare against")
    parser.add_argument("--workers-list", default="1,2", help="worker counts of the scaling table")
    parser.add_argument("--resnet-workers", type=int, default=0, help="geserve's --workers for ResNet-50 (0: auto)")
    args = parser.parse_args()
    mode = harness.QUICK if args.quick else harness.FULL
    if args.rounds:
        mode = Mode(**{**asdict(mode), "rounds": args.rounds})
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    workers_list = [int(n) for n in args.workers_list.split(",") if n.strip()]
    started = time.monotonic()
    harness.ensure_installed(["mlp", "resnet50"] if "resnet" in sections else ["mlp"])
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    os.environ[reference.ORT_THREADS_ENV] = str(threads_per_instance(1))  # Triton's models: geserve's threads
    cells = plan(sections, workers_list)
    samples = Samples(quiet_budget_s=mode.quiet_wait_s)
    results = Results()
    with tempfile.TemporaryDirectory(prefix="workers-bench-") as tmp, ExitStack() as stack:
        servers = start_servers(stack, cells, Path(tmp), args.baseline, args.resnet_workers)
        results.processes = {name: tree_size(server.pid) for name, server in servers.items()}
        for index in range(mode.rounds):
            print(f"round {index + 1}/{mode.rounds}", flush=True)
            run_round(index, cells, servers, mode, samples, results)
        print("stopping servers", file=sys.stderr, flush=True)
    found = targets(results, cells, sections)
    meta: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": harness.machine(),
        "command": " ".join([".venv/bin/python", "bench/workers_bench.py", *sys.argv[1:]]),
        "commit": commit(),
        "baseline": args.baseline, "sections": sections, "seconds": time.monotonic() - started,
    }
    text = report(results, cells, servers, samples, mode, found, meta)
    (harness.RESULTS / "workers.md").write_text(text)
    (harness.RESULTS / "workers.json").write_text(json.dumps({
        "meta": meta, "mode": asdict(mode),
        "servers": {n: {"label": s.label, "workers": s.workers, "processes": results.processes.get(n)}
                    for n, s in servers.items()},
        "cells": [asdict(cell) for cell in cells],
        "rounds": {key: [None if s is None else {**asdict(s), "server_cpu_us": s.server_cpu_us,
                                                 "pa_cpu_us": s.pa_cpu_us, "server_cores": s.server_cores,
                                                 "pa_cores": s.pa_cores} for s in runs]
                   for key, runs in results.rounds.items()},
        "ab": ab_rows(results, cells),
        "resnet50_raw": [asdict(r) for r in results.raw],
        "resnet50_raw_best_again": results.raw_again,
        "targets": [{"target": t, "passed": ok, "detail": d} for t, ok, d in found],
        "others_cpu_share": samples.others, "loose": samples.loose, "commands": samples.commands,
    }, indent=1))
    print(text)
    print("\n".join(target_lines(found)))
    print(f"written to {(harness.RESULTS / 'workers.md').relative_to(ROOT)} and workers.json "
          f"in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
