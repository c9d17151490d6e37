"""What tracing costs a request: the example MLP at concurrency 16 over HTTP with tracing off, with Triton-mode
tracing at rate 1/1000 (TIMESTAMPS to a trace file), and with OpenTelemetry tracing at rate 1/1000 (spans exported
over OTLP/HTTP to a receiver in this process), perf_analyzer in alternating rounds.

One geserve process per configuration, all started once; only one is driven at a time, and the order rotates each
round. Reported per configuration: throughput and p50 at c=16, and the server's CPU per request (its CPU time over
the requests it answered meanwhile), the steadiest of the three on a shared machine. Writes bench/results/trace.md
and trace.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

from tests.support import models  # noqa: E402
from tests.support.reference import free_port, run_perf_analyzer  # noqa: E402
from tests.support.server import RunningServer, stop_geserve  # noqa: E402

MODEL = "mlp"
CONCURRENCY = 16
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CELLS = ("c=16 (infer/s)", "c=16 p50 (µs)", "server CPU / request (µs)")


@dataclass
class Config:
    name: str
    server_args: list[str]
    server: RunningServer | None = None
    samples: list[dict[str, float | None]] = field(default_factory=list)


class NullReceiver:
    """An OTLP/HTTP endpoint that accepts every export and counts its bytes (the spans are not decoded)."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                receiver.bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.exports += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def configs(folder: Path, receiver: NullReceiver) -> list[Config]:
    rate = ["--trace-config", "rate=1000", "--trace-config", "level=TIMESTAMPS"]
    return [
        Config("tracing off", []),
        Config("triton, rate 1/1000", [*rate, "--trace-config", f"triton,file={folder / 'trace.json'}",
                                       "--trace-config", "triton,log-frequency=100"]),
        Config("opentelemetry, rate 1/1000", [*rate, "--trace-config", "mode=opentelemetry",
                                              "--trace-config", f"opentelemetry,url={receiver.url}"]),
    ]


def _single_process_flag() -> list[str]:
    """`--workers 1` where the server has worker processes: every configuration is measured as one process."""
    help_text = subprocess.run([sys.executable, "-m", "geserve", "serve", "--help"], capture_output=True, text=True,
                               cwd=ROOT).stdout
    return ["--workers", "1"] if "--workers" in help_text else []


@contextmanager
def serve(config: Config, repo: Path, log_path: Path, extra: list[str]) -> Iterator[RunningServer]:
    http_port = free_port()
    command = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(repo), "--http-address",
               "127.0.0.1", "--http-port", str(http_port), "--allow-grpc=false", "--allow-metrics=false",
               *extra, *config.server_args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ))
    server = RunningServer(process, http_port, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{config.name}: geserve did not come up:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{server.base}/v2/health/ready", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.1)
        yield server
    finally:
        stop_geserve(server)


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def measure(config: Config, mode: harness.Mode) -> dict[str, float | None]:
    server = config.server
    assert server is not None
    cpu0, count0 = server_cpu_s(server.process.pid), harness.served_count(f"127.0.0.1:{server.http_port}", MODEL)
    with harness.others_share() as others:
        point = perf_analyzer(server, mode)
    cpu1, count1 = server_cpu_s(server.process.pid), harness.served_count(f"127.0.0.1:{server.http_port}", MODEL)
    return {
        CELLS[0]: None if point is None else point.throughput,
        CELLS[1]: None if point is None else point.p50_us,
        CELLS[2]: (cpu1 - cpu0) / (count1 - count0) * 1e6 if count1 > count0 else None,
        "others": others[0],
    }


def perf_analyzer(server: RunningServer, mode: harness.Mode) -> harness.Point | None:
    """One perf_analyzer run (harness.py's settings); retried once at stability 100% and 3x the window."""
    output = ""
    for stability, window in ((mode.stability, mode.window_ms), (100, 3 * mode.window_ms)):
        with tempfile.TemporaryDirectory(prefix="trace-pa-") as tmp:
            csv_path = Path(tmp) / "pa.csv"
            args = ["-m", MODEL, "-u", f"127.0.0.1:{server.http_port}", "-i", "http", "--concurrency-range",
                    str(CONCURRENCY), "--measurement-interval", str(window), "--stability-percentage", str(stability),
                    "--max-trials", str(mode.max_trials), "-f", str(csv_path)]
            result = run_perf_analyzer(args, timeout=60 + mode.max_trials * window / 1000 * 2)
            point = harness.read_csv_point(csv_path)
            output = result.stdout + result.stderr
        if point is not None:
            return point
    print(f"  perf_analyzer gave no result: {output[-800:]}", file=sys.stderr)
    return None


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(all_configs: list[Config], mode: harness.Mode, rounds: int, receiver: NullReceiver) -> str:
    base = all_configs[0]
    lines = [
        "# Tracing cost: MLP at c=16 over HTTP, tracing off vs rate 1/1000 (perf_analyzer)",
        "",
        f"{rounds} alternating rounds, median per cell; perf_analyzer window {mode.window_ms} ms, stability "
        f"{mode.stability}%. Date: {time.strftime('%Y-%m-%d')}. Machine: {harness.machine()}.",
        "",
        "| configuration | " + " | ".join(CELLS) + " | throughput vs off | rounds (infer/s) | others' CPU |",
        "|---|" + "---:|" * len(CELLS) + "---:|---|---:|",
    ]
    base_rate = median([s[CELLS[0]] for s in base.samples])
    for config in all_configs:
        cells = [median([s[label] for s in config.samples]) for label in CELLS]
        versus = f"{cells[0] / base_rate - 1:+.1%}" if cells[0] and base_rate else "n/a"
        shown = " | ".join("n/a" if v is None else f"{v:.0f}" for v in cells)
        rounds_text = ", ".join("-" if s[CELLS[0]] is None else f"{s[CELLS[0]]:.0f}" for s in config.samples)
        others = median([s["others"] for s in config.samples]) or 0.0
        lines.append(f"| {config.name} | {shown} | {versus} | {rounds_text} | {others:.0%} |")
    lines += [
        "",
        "Tracing off, the request path pays one attribute test in the service and the frontend (is a tracer set?). "
        "At rate 1/1000 the 999 untraced requests pay the sampling counter; the traced one records ~12 timestamps "
        "and, in Triton mode, joins the trace file (written every 100 traces), in OpenTelemetry mode becomes 4 "
        f"spans handed to the SDK's batch span processor (here {receiver.exports} exports, {receiver.bytes} bytes, "
        "to a receiver in the benchmark's process). This VM moves ±15-30% between runs: differences within that "
        "are noise; `others' CPU` above ~15% disturbs every column.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="short perf_analyzer windows, one round")
    args = parser.parse_args()
    mode = harness.QUICK if args.quick else harness.FULL
    rounds = args.rounds or mode.rounds
    models.example_onnx(MODEL)  # builds the example MLP if it is not built yet
    if not harness.reference.perf_analyzer_path().is_file():
        print("perf_analyzer is missing: run scripts/install_reference.sh first", file=sys.stderr)
        return 1
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    receiver = NullReceiver()
    extra = _single_process_flag()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="trace-bench-") as tmp:
        repo = harness.model_repository([MODEL], Path(tmp) / "repo")
        all_configs = configs(Path(tmp), receiver)
        for index, config in enumerate(all_configs):
            log = harness.RESULTS / f"trace.{index}.log"
            config.server = stack.enter_context(serve(config, repo, log, extra))
        for index in range(rounds):
            order = all_configs[index % len(all_configs):] + all_configs[:index % len(all_configs)]
            for config in order:
                print(f"round {index + 1}: {config.name}", file=sys.stderr)
                harness.wait_for_quiet(10)
                config.samples.append(measure(config, mode))
    receiver.close()
    text = report(all_configs, mode, rounds, receiver)
    print(text)
    (harness.RESULTS / "trace.md").write_text(text)
    (harness.RESULTS / "trace.json").write_text(json.dumps(
        {config.name: {"server_args": config.server_args, "rounds": config.samples} for config in all_configs},
        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
