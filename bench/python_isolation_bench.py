"""What `isolation: process` costs a Python model (issue 34, part 5), measured.

Sections:
- latency: a tiny model (Triton's add_sub, FP32 [4]) in geserve's process, in a process of its own, and on the real
  Triton 2.51 (whose Python backend always runs a model in its stub process): perf_analyzer over HTTP at concurrency
  1 (p50, p99) and 4 (throughput), with the server's CPU per inference (its whole process tree, from /proc);
  alternating rounds, medians.
- payload: an identity model (OUT = IN, FP32) with 16 KiB, 1 MiB and 16 MiB inputs, the same three systems, c=1 p50.
- transport: one array across the lane isolated models execute on (ipc/lane.py) and back a tiny answer, in the frame
  or through the shared memory segment (ipc/arena.py), two processes of this benchmark: what SHARED_FROM_BYTES
  rests on.
- process: an isolated instance's process (RSS, PSS), the load time of the model in-process and isolated, and the
  time from a crash's answer to serving again.

Writes bench/results/python_isolation.md. Run alone: `flock -x /tmp/geserve-cpu.lock .venv/bin/python
bench/python_isolation_bench.py [--quick] [--rounds N] [--only latency,payload,transport,process]`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from geserve.ipc.arena import ArenaReader, ArenaWriter, Segment, SharedArrayCodec, create_segment  # noqa: E402
from geserve.ipc.lane import Lane, serve  # noqa: E402
from geserve.tune.machine import others_share, tree_cpu_s  # noqa: E402
from tests.support import reference  # noqa: E402
from tests.support.python_repo import ISOLATION, PYTHON_MODELS  # noqa: E402
from tests.support.server import RunningServer, geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SYSTEMS = ("in-process", "isolated", "triton")
SUFFIX = {"in-process": "", "isolated": "_isolated", "triton": ""}
PAYLOADS = {"16 KiB": 4096, "1 MiB": 262_144, "16 MiB": 4_194_304}  # FP32 elements
TRANSPORT_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20)
ECHO_MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
'''
ECHO_CONFIG = '''name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
'''


@dataclass
class Cell:
    """One measured cell's samples over the rounds."""

    p50_us: list[float] = field(default_factory=list)
    p99_us: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    others: list[float] = field(default_factory=list)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def shown(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- repositories and servers ---------------------------------------------------------------------------------------


def copy_model(source: Path, dest: Path, name: str, isolated: bool) -> None:
    shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    config = dest / name / "config.pbtxt"
    text = config.read_text().replace(f'name: "{source.name}"', f'name: "{name}"')
    config.write_text(text.rstrip("\n") + "\n" + (ISOLATION if isolated else ""))


def echo_model(dest: Path, name: str, isolated: bool) -> None:
    (dest / name / "1").mkdir(parents=True)
    (dest / name / "1" / "model.py").write_text(ECHO_MODEL)
    (dest / name / "config.pbtxt").write_text(ECHO_CONFIG.format(name=name) + (ISOLATION if isolated else ""))


def repositories(tmp: Path) -> tuple[Path, Path]:
    ours, theirs = tmp / "geserve", tmp / "triton"
    for isolated in (False, True):
        suffix = SUFFIX["isolated"] if isolated else ""
        copy_model(PYTHON_MODELS / "add_sub", ours, "add_sub" + suffix, isolated)
        echo_model(ours, "echo" + suffix, isolated)
    shutil.copytree(PYTHON_MODELS / "crash", ours / "crash", ignore=shutil.ignore_patterns("__pycache__"))
    copy_model(PYTHON_MODELS / "add_sub", theirs, "add_sub", False)
    echo_model(theirs, "echo", False)
    return ours, theirs


@dataclass(frozen=True)
class Target:
    system: str
    http: str  # host:port
    pid: int  # the server's root process (its tree is charged)

    def model(self, name: str) -> str:
        return name + SUFFIX[self.system]


def perf(target: Target, model: str, concurrency: int, mode: harness.Mode, extra: list[str]) -> harness.Point | None:
    """One perf_analyzer run (HTTP, binary tensors); None when it never settled."""
    for stability, window in ((mode.stability, mode.window_ms), (100, 3 * mode.window_ms)):
        with tempfile.TemporaryDirectory(prefix="isolation-pa-") as tmp:
            csv_path = Path(tmp) / "pa.csv"
            args = ["-m", target.model(model), "-u", target.http, "-i", "http", "--concurrency-range",
                    str(concurrency), "--measurement-interval", str(window), "--stability-percentage", str(stability),
                    "--max-trials", str(mode.max_trials), "-f", str(csv_path), *extra]
            reference.run_perf_analyzer(args, timeout=120 + mode.max_trials * window / 500)
            point = harness.read_csv_point(csv_path)
        if point is not None:
            return point
    return None


def measure(target: Target, model: str, concurrency: int, mode: harness.Mode, cell: Cell,
            extra: tuple[str, ...] = ()) -> None:
    """A perf_analyzer run into `cell`, with the server's CPU per inference over it."""
    served = target.model(model)
    count, cpu = harness.served_count(target.http, served), tree_cpu_s(target.pid)
    with others_share() as share:
        point = perf(target, model, concurrency, mode, list(extra))
    cpu, count = tree_cpu_s(target.pid) - cpu, harness.served_count(target.http, served) - count
    cell.others.extend(share)
    if point is None:
        print(f"  {target.system} {model} c={concurrency}: no result", flush=True)
        return
    cell.p50_us.append(point.p50_us)
    cell.p99_us.append(point.p99_us)
    cell.throughput.append(point.throughput)
    if count:
        cell.cpu_us.append(cpu / count * 1e6)
    print(f"  {target.system} {model} c={concurrency} {' '.join(extra)}: p50 {point.p50_us:.0f} µs, "
          f"{point.throughput:.0f}/s", flush=True)


# ---- sections -------------------------------------------------------------------------------------------------------


def latency(targets: list[Target], mode: harness.Mode) -> list[str]:
    cells = {(t.system, c): Cell() for t in targets for c in (1, 4)}
    for round_index in range(mode.rounds):
        order = targets[round_index % len(targets):] + targets[: round_index % len(targets)]
        for target in order:
            for concurrency in (1, 4):
                measure(target, "add_sub", concurrency, mode, cells[(target.system, concurrency)])
    base = {c: median(cells[("in-process", c)].p50_us) for c in (1, 4)}
    lines = ["| system | c=1 p50 µs | c=1 p99 µs | c=1 infer/s | c=1 server CPU µs/inf | c=4 infer/s | "
             "c=4 p50 µs | c=4 server CPU µs/inf | c=1 p50 over in-process |", "|---|" + "---:|" * 8]
    for target in targets:
        one, four = cells[(target.system, 1)], cells[(target.system, 4)]
        p50 = median(one.p50_us)
        extra = f"+{p50 - base[1]:.0f} µs" if p50 is not None and base[1] is not None else "-"
        lines.append(f"| {target.system} | {shown(p50)} | {shown(median(one.p99_us))} | "
                     f"{shown(median(one.throughput))} | {shown(median(one.cpu_us))} | "
                     f"{shown(median(four.throughput))} | {shown(median(four.p50_us))} | "
                     f"{shown(median(four.cpu_us))} | {extra} |")
    return lines


def payload(targets: list[Target], mode: harness.Mode) -> list[str]:
    cells = {(t.system, size): Cell() for t in targets for size in PAYLOADS}
    for round_index in range(mode.rounds):
        order = targets[round_index % len(targets):] + targets[: round_index % len(targets)]
        for target in order:
            for size, elements in PAYLOADS.items():
                measure(target, "echo", 1, mode, cells[(target.system, size)], ("--shape", f"IN:{elements}"))
    lines = ["| system | " + " | ".join(f"{size} p50 µs" for size in PAYLOADS) + " |",
             "|---|" + "---:|" * len(PAYLOADS)]
    for target in targets:
        lines.append(f"| {target.system} | "
                     + " | ".join(shown(median(cells[(target.system, size)].p50_us)) for size in PAYLOADS) + " |")
    return lines


def transport(mode: harness.Mode) -> list[str]:
    """One array to another process and a tiny answer back, on a lane: in the frame vs through the segment."""
    ours, theirs = socket.socketpair()
    segment_fd = create_segment()
    child = subprocess.Popen([sys.executable, __file__, "--transport-child", str(theirs.fileno()), str(segment_fd)],
                             pass_fds=(theirs.fileno(), segment_fd))
    theirs.close()
    writer = ArenaWriter(Segment(segment_fd))
    os.close(segment_fd)
    lanes = {False: Lane(ours, SharedArrayCodec(None, None)), True: Lane(ours, SharedArrayCodec(writer, None))}
    rows = ["| array | in the frame µs | through the segment µs | frame / segment |", "|---|---:|---:|---:|"]
    try:
        for size in TRANSPORT_SIZES:
            data = np.ones(size // 4, np.float32)
            timings: dict[bool, list[float]] = {False: [], True: []}
            trips = max(5, min(2000, (50 if mode.rounds == 1 else 200) * (1 << 20) // size))
            for _ in range(mode.rounds):
                for shared, lane in lanes.items():
                    timings[shared].append(_trips(lane, writer, data, trips))
            frame, segment = median(timings[False]), median(timings[True])
            ratio = f"{frame / segment:.1f}" if frame and segment else "-"
            rows.append(f"| {size >> 10} KiB | {shown(frame, 1)} | {shown(segment, 1)} | {ratio} |")
            print(f"  transport {size >> 10} KiB: frame {frame:.1f} µs, segment {segment:.1f} µs", flush=True)
    finally:
        lanes[True].close()  # the socket both use
        child.wait(10)
    return rows


def _trips(lane: Lane, writer: ArenaWriter, data: np.ndarray, trips: int) -> float:
    """µs per trip (median of the trips)."""
    samples = []
    for _ in range(trips):
        started = time.perf_counter()
        released = lane.call("size", data)
        samples.append((time.perf_counter() - started) * 1e6)
        writer.free(released)
    return statistics.median(samples)


def transport_child(sock_fd: int, segment_fd: int) -> None:
    released: list[int] = []
    reader = ArenaReader(Segment(segment_fd), released.append)
    os.close(segment_fd)

    def size(_: str, array: np.ndarray) -> list[int]:
        """The blocks let go of so far (this call's goes once its message does: in the next answer)."""
        done, released[:] = list(released), []
        return done

    serve(socket.socket(fileno=sock_fd), SharedArrayCodec(None, reader), size)


def process_costs(server: RunningServer, rounds: int) -> list[str]:
    """The isolated add_sub process' memory, the load time in-process vs isolated, a crash's restart time."""
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    try:
        loads: dict[str, list[float]] = {"add_sub": [], "add_sub_isolated": []}
        for _ in range(rounds):
            for model in loads:
                client.unload_model(model)
                started = time.monotonic()
                client.load_model(model)
                loads[model].append(time.monotonic() - started)
        rss, pss = _child_memory(server, "add_sub_isolated_0_0")
        restarts = [_restart_s(client) for _ in range(rounds)]
    finally:
        client.close()
    return [
        "| what | value |", "|---|---:|",
        f"| load, in-process (median of {rounds}) | {median(loads['add_sub']):.2f} s |",
        f"| load, isolated (one process started: auto_complete_config, then the instance, in it) | "
        f"{median(loads['add_sub_isolated']):.2f} s |",
        f"| an isolated add_sub instance's process: RSS | {rss / 2**20:.1f} MiB |",
        f"| the same: PSS (its share of pages it shares) | {pss / 2**20:.1f} MiB |",
        f"| from a crash's answer (SIGABRT) to serving again, median of {rounds} | {median(restarts):.2f} s |",
    ]


def _child_memory(server: RunningServer, instance: str) -> tuple[int, int]:
    """(RSS, PSS) bytes of the process of `instance`, as the server's log last named it."""
    pid = re.findall(rf"Python model instance '{instance}' runs in process (\d+)", server.log())[-1]
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    fields = dict(line.split(":", 1) for line in rollup)
    return int(fields["Rss"].split()[0]) * 1024, int(fields["Pss"].split()[0]) * 1024


def _restart_s(client: httpclient.InferenceServerClient) -> float:
    def infer(command: int) -> Any:
        tensor = httpclient.InferInput("CMD", [1], "INT32")
        tensor.set_data_from_numpy(np.array([command], np.int32))
        return client.infer("crash", [tensor])

    infer(0)
    try:
        infer(-1)
    except InferenceServerException:
        pass
    else:
        raise RuntimeError("the crash model answered the command that aborts it")
    crashed = time.monotonic()
    infer(0)  # waits for the restarted process
    return time.monotonic() - crashed


# ---- main -----------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="latency,payload,transport,process")
    parser.add_argument("--transport-child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transport_child:
        transport_child(*args.transport_child)
        return 0
    mode = harness.QUICK if args.quick else harness.Mode(
        rounds=args.rounds, window_ms=1500, requests_per_window=60, stability=25, max_trials=8, raw_budget_s=0,
        quiet_wait_s=0)
    sections = args.only.split(",")
    started = time.monotonic()
    report = ["# What `isolation: process` costs a Python model", "",
              f"{time.strftime('%Y-%m-%d')}, {mode.rounds} alternating round(s), medians; {harness.machine()}. "
              f"`{' '.join(['python', *sys.argv])}`", ""]
    with tempfile.TemporaryDirectory(prefix="isolation-bench-") as tmp, ExitStack() as stack:
        ours, theirs = repositories(Path(tmp))
        server = stack.enter_context(geserve([ours], RESULTS / "python_isolation.server.log",
                                             ["--model-control-mode=explicit",
                                              *(f"--load-model={m.name}" for m in ours.iterdir())]))
        targets = [Target("in-process", server.url, server.process.pid),
                   Target("isolated", server.url, server.process.pid)]
        if {"latency", "payload"} & set(sections) and reference.reference_available():
            triton = reference.BootingTriton(theirs, Path(tmp))
            stack.callback(triton.stop)
            triton.wait()
            targets.append(Target("triton", triton.http, triton.process.pid))
        _warm(targets)
        steps: dict[str, tuple[str, Callable[[], list[str]]]] = {
            "latency": ("Latency of a tiny model (add_sub, FP32 [4]), HTTP", lambda: latency(targets, mode)),
            "payload": ("An identity model, HTTP c=1, by input size", lambda: payload(targets, mode)),
            "transport": ("One array across the execute lane and a tiny answer back (two processes, no server)",
                          lambda: transport(mode)),
            "process": ("An isolated instance's process", lambda: process_costs(server, max(1, mode.rounds))),
        }
        for name in sections:
            title, step = steps[name]
            print(f"{name}:", flush=True)
            report += [f"## {title}", "", *step(), ""]
    report += [
        "Server CPU: the whole process tree (geserve's server and its model processes; tritonserver and its stubs) "
        "over the inferences of the run. Triton: 2.51 from the nvidia-pytriton wheel, its Python backend (every "
        "model in a stub process). perf_analyzer: binary tensors, "
        f"`--measurement-interval {mode.window_ms} --stability-percentage {mode.stability}`.",
        f"Run time {time.monotonic() - started:.0f} s. This VM moves ±15-30% between runs: compare rows of one run.",
    ]
    text = "\n".join(report) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "python_isolation.md").write_text(text)
    print(text)
    return 0


def _warm(targets: list[Target]) -> None:
    for target in targets:
        with httpclient.InferenceServerClient(target.http) as client:
            a = np.ones(4, np.float32)
            inputs = [httpclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(a)
            for _ in range(20):
                client.infer(target.model("add_sub"), inputs)


if __name__ == "__main__":
    raise SystemExit(main())
