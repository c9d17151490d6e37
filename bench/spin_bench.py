"""The batched path's thread policy: one MLP batch of 16 rows, run back to back or after an idle gap (as batches
arrive from a dynamic batcher with a 2 ms queue delay), by ONNX Runtime with 1 intra-op thread, and with 2 threads
with spinning off, on, and on for a bounded time (`session.intra_op.spin_duration_us`: the threads stay warm while
batches come back to back and sleep once the gap is longer, ONNX Runtime's own adaptive policy). Reports latency
p50 and the process's CPU per batch (spinning threads included), in alternating rounds. Writes bench/results/spin.md.

Usage: .venv/bin/python bench/spin_bench.py [--rounds N] [--batches N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "model_repository" / "mlp" / "1" / "model.onnx"
SPIN_US = 200  # the bounded policy's spin: longer than a back-to-back batch's gap here, shorter than an idle one
POLICIES = (("1 thread", 1, "0", None), ("2 threads, spinning off", 2, "0", None),
            ("2 threads, spinning on", 2, "1", None), (f"2 threads, spinning for {SPIN_US} µs", 2, "1", SPIN_US))
GAPS_MS = (0.0, 0.5, 2.0)


def session(threads: int, spinning: str, spin_us: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    if spin_us is not None:
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
    return ort.InferenceSession(str(MODEL), options, providers=["CPUExecutionProvider"])


def measure(sess: ort.InferenceSession, gap_ms: float, batches: int) -> tuple[float, float]:
    """(p50 latency µs, process CPU µs per batch) over `batches` runs, each after `gap_ms` of sleep."""
    name = sess.get_inputs()[0].name
    feed = {name: np.random.default_rng(0).standard_normal((16, 256), dtype=np.float32)}
    for _ in range(20):
        sess.run(None, feed)
    latencies = []
    cpu_start, wall_busy = time.process_time(), 0.0
    for _ in range(batches):
        if gap_ms:
            time.sleep(gap_ms / 1000)
        start = time.perf_counter()
        sess.run(None, feed)
        latencies.append(time.perf_counter() - start)
        wall_busy += latencies[-1]
    cpu = time.process_time() - cpu_start
    return statistics.median(latencies) * 1e6, cpu / batches * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=400)
    args = parser.parse_args()
    sessions = {label: session(threads, spin, spin_us) for label, threads, spin, spin_us in POLICIES}
    results: dict[tuple[str, float], list[tuple[float, float]]] = {}
    for round_index in range(args.rounds):
        order = list(sessions.items())
        order = order[round_index % len(order):] + order[: round_index % len(order)]
        for gap in GAPS_MS:
            for label, sess in order:
                results.setdefault((label, gap), []).append(measure(sess, gap, args.batches))
    lines = [
        "# Batched path: thread policy for a b=16 MLP batch", "",
        f"{args.rounds} alternating rounds x {args.batches} batches; median of rounds. CPU per batch is the whole "
        "process's (spinning threads included).", "",
        "| policy | gap before each batch | p50 latency (µs) | CPU per batch (µs) |", "|---|---:|---:|---:|",
    ]
    for gap in GAPS_MS:
        for label, *_ in POLICIES:
            samples = results[(label, gap)]
            p50 = statistics.median(s[0] for s in samples)
            cpu = statistics.median(s[1] for s in samples)
            lines.append(f"| {label} | {gap:g} ms | {p50:.0f} | {cpu:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "bench" / "results" / "spin.md"
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
