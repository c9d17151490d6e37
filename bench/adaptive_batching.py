"""Adaptive batching under load that rises and falls: does the p99 target hold while throughput follows?

Serves the example MLP twice from one geserve: with a fixed dynamic batcher (2 ms queue delay, full batch)
and with `adaptive_batching_target_p99_ms`, then walks perf_analyzer's concurrency up and down
(1, 4, 16, 32, 16, 4, 1), alternating the two models at each step. Writes bench/results/adaptive.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from google.protobuf import text_format

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geserve.config import parse_config_text  # noqa: E402
from tests.support.reference import run_perf_analyzer  # noqa: E402
from tests.support.server import geserve  # noqa: E402

EXAMPLE = ROOT / "examples" / "model_repository" / "mlp"
RESULTS = ROOT / "bench" / "results"
PHASES = (1, 4, 16, 32, 16, 4, 1)


def make_repository(dest: Path, target_ms: float) -> Path:
    for name, adaptive in (("mlp_fixed", False), ("mlp_adaptive", True)):
        model = dest / name
        model.mkdir(parents=True)
        (model / "1").symlink_to(EXAMPLE / "1", target_is_directory=True)
        config = parse_config_text((EXAMPLE / "config.pbtxt").read_text(), "mlp")
        config.name = name
        config.dynamic_batching.max_queue_delay_microseconds = 2000
        if adaptive:
            config.parameters["adaptive_batching_target_p99_ms"].string_value = str(target_ms)
        (model / "config.pbtxt").write_text(text_format.MessageToString(config))
    return dest


def measure(url: str, model: str, concurrency: int, window_ms: int) -> tuple[float, float, float]:
    result = run_perf_analyzer(
        ["-m", model, "-u", url, "--concurrency-range", str(concurrency), "--measurement-interval", str(window_ms),
         "--stability-percentage", "50", "--max-trials", "6"],
        timeout=120,
    )
    output = result.stdout + result.stderr
    throughput = re.search(r"Throughput: ([\d.]+) infer/sec", output)
    p50, p99 = re.search(r"p50 latency: (\d+) usec", output), re.search(r"p99 latency: (\d+) usec", output)
    if not (throughput and p50 and p99):
        return float("nan"), float("nan"), float("nan")
    return float(throughput.group(1)), float(p50.group(1)), float(p99.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-ms", type=float, default=3.0)
    parser.add_argument("--window-ms", type=int, default=2000)
    args = parser.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="adaptive-") as tmp:
        repo = make_repository(Path(tmp) / "models", args.target_ms)
        with geserve([repo], Path(tmp) / "geserve.log") as server:
            for step, concurrency in enumerate(PHASES):
                for model in ("mlp_fixed", "mlp_adaptive") if step % 2 == 0 else ("mlp_adaptive", "mlp_fixed"):
                    rows.append((step, concurrency, model, *measure(server.url, model, concurrency, args.window_ms)))
                    print(f"step {step} c={concurrency} {model}: {rows[-1][3]:.0f}/s p99 {rows[-1][5]:.0f} µs",
                          flush=True)
    target_us = args.target_ms * 1000
    table = ["| step | concurrency | model | infer/s | p50 µs | p99 µs | p99 within target |",
             "|---:|---:|---|---:|---:|---:|---|"]
    for step, concurrency, model, throughput, p50, p99 in rows:
        held = "yes" if p99 <= target_us else "no"
        table.append(f"| {step} | {concurrency} | {model} | {throughput:.0f} | {p50:.0f} | {p99:.0f} | {held} |")
    text = "\n".join(table)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "adaptive.md").write_text(
        f"# Adaptive batching, p99 target {args.target_ms} ms\n\n{time.strftime('%Y-%m-%d %H:%M:%S')}; "
        f"perf_analyzer windows of {args.window_ms} ms, concurrency walked {PHASES}.\n\n{text}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
