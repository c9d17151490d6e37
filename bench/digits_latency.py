"""One binary-tensor request to the digits model: perf_analyzer p50 against geserve vs a raw ONNX Runtime call.

Alternates the two systems over several rounds so machine noise hits both alike; prints a table and
writes it, with the exact commands and versions, to bench/results/digits_latency.md.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geserve.devices import threads_per_instance  # noqa: E402
from geserve.version import __version__  # noqa: E402
from tests.support import models  # noqa: E402
from tests.support.reference import run_perf_analyzer  # noqa: E402
from tests.support.server import geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def raw_onnxruntime(model_path: Path, pixels: np.ndarray, calls: int) -> list[float]:
    """Microseconds per session.run on one image, with the session options geserve uses for one instance."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads_per_instance(1)
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    feed = {"pixels": pixels[:1]}
    for _ in range(200):
        session.run(None, feed)
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        session.run(None, feed)
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def perf_analyzer_p50(url: str, interval_ms: int) -> tuple[float, float, float, list[str]]:
    args = ["-m", "digits", "-u", url, "--concurrency-range", "1", "--measurement-interval", str(interval_ms),
            "--stability-percentage", "20"]
    result = run_perf_analyzer(args, timeout=300)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(output[-3000:])
    p50 = float(re.search(r"p50 latency: (\d+) usec", output).group(1))
    p99 = float(re.search(r"p99 latency: (\d+) usec", output).group(1))
    throughput = float(re.search(r"Throughput: ([\d.]+) infer/sec", output).group(1))
    return p50, p99, throughput, ["perf_analyzer", *args]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one short round")
    args = parser.parse_args()
    rounds, interval, calls = (1, 1000, 2000) if args.quick else (args.rounds, 3000, 5000)

    repo = ROOT / "examples" / "model_repository"
    sys.path.insert(0, str(ROOT / "examples"))
    from build_digits import build

    build(repo, ROOT / "examples" / ".build")  # no-op when already built
    pixels, _ = models.digits_test_set()
    model_path = repo / "digits" / "1" / "model.onnx"
    raw_p50, raw_p99, served_p50, served_p99, served_tput = [], [], [], [], []
    command: list[str] = []
    log = ROOT / "bench" / "results" / "digits_latency.server.log"  # git-ignored
    with geserve([repo], log) as server:
        for _ in range(rounds):
            samples = raw_onnxruntime(model_path, pixels, calls)
            raw_p50.append(float(np.percentile(samples, 50)))
            raw_p99.append(float(np.percentile(samples, 99)))
            p50, p99, tput, command = perf_analyzer_p50(server.url, interval)
            served_p50.append(p50)
            served_p99.append(p99)
            served_tput.append(tput)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    rows = [
        ("raw ONNX Runtime session.run (in-process)", med(raw_p50), med(raw_p99), "-"),
        (
            "geserve HTTP, binary tensors, perf_analyzer c=1",
            med(served_p50),
            med(served_p99),
            f"{med(served_tput):.0f}",
        ),
    ]
    table = ["| system | p50 µs | p99 µs | infer/s |", "|---|---:|---:|---:|"]
    table += [f"| {name} | {p50:.0f} | {p99:.0f} | {tput} |" for name, p50, p99, tput in rows]
    table.append(f"| geserve minus raw (server + HTTP + client overhead) | {med(served_p50) - med(raw_p50):.0f} | | |")
    text = "\n".join(table)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = RESULTS / "digits_latency.md"
    report.write_text(
        "# digits: one binary-tensor request, concurrency 1\n\n"
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {rounds} alternating round(s), medians shown.\n\n"
        f"{text}\n\n"
        f"- geserve {__version__}, onnxruntime {ort.__version__}, numpy {np.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()}, {threads_per_instance(1)} intra-op threads\n"
        f"- raw: `session.run` on one 1x64 FP32 image, {calls} calls after 200 warm-up calls\n"
        f"- served: `{' '.join(command)}`\n"
    )
    print(f"written to {report.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
