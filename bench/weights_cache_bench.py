"""What a batched MLP run costs once its weights have left the cache: one b=8 run of the example MLP (5.3 MB of
weights, one intra-op thread) after a gap, as each worker's batches come every 2-3 ms in issue 15's batched cell.

Cells: back to back; after a sleep of 0.2, 1 and 5 ms; after 1 ms of a busy loop (the core never idles, so idle
states are not the cause); after touching 8 MB of other memory; and two processes running at once with 1 ms gaps,
each with its own session ("private", as two workers had before `share_weights`), sharing one session's pages (made
before `fork`), or each with its own session of the graph whose prepacked weights both map from one file (what
geserve's workers do: geserve/backends/ge/shared_weights.py). Reports the thread's CPU per run, medians over the
rounds. Writes bench/results/weights_cache.md.

Usage: .venv/bin/python bench/weights_cache_bench.py [--rounds N] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from report_table import median_rows

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "model_repository" / "mlp" / "1" / "model.onnx"
BATCH = 8
WARM_RUNS = 30


def _options() -> Any:
    import onnxruntime as ort  # here, not at the top: "private" children fork before either imports it

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def _session(graph: Path = MODEL) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(str(graph), _options(), providers=["CPUExecutionProvider"])


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cpu_per_run(session: Any, between: Callable[[], None], runs: int) -> float:
    """CPU µs of this thread per b=8 run, each run after `between()`."""
    feed = {"input": np.random.default_rng(0).standard_normal((BATCH, 256), dtype=np.float32)}
    total = 0
    for index in range(runs + WARM_RUNS):
        between()
        started = time.thread_time_ns()
        session.run(None, feed)
        if index >= WARM_RUNS:
            total += time.thread_time_ns() - started
    return total / runs / 1e3


def single_cells(runs: int) -> dict[str, float]:
    session = _session()
    junk = np.ones(8 * 1024 * 1024 // 8)

    def evict() -> None:
        np.add(junk, 1.0, out=junk)

    gaps: list[tuple[str, Callable[[], None]]] = [
        ("back to back", lambda: None),
        ("after a 0.2 ms sleep", lambda: time.sleep(0.0002)),
        ("after a 1 ms sleep", lambda: time.sleep(0.001)),
        ("after a 5 ms sleep", lambda: time.sleep(0.005)),
        ("after 1 ms of a busy loop", lambda: _busy(0.001)),
        ("after touching 8 MB of other memory", evict),
    ]
    return {label: cpu_per_run(session, between, runs) for label, between in gaps}


def child(mode: str, runs: int, graph: Path) -> None:
    """Two processes with 1 ms gaps; prints each one's CPU per run as JSON lines."""
    session = _session() if mode == "shared" else None
    pid = os.fork()
    if session is None:
        session = _session(graph)
    cost = cpu_per_run(session, lambda: time.sleep(0.001), runs)
    os.write(1, (json.dumps(cost) + "\n").encode())  # one write: print's two could interleave with the other's
    if pid:
        os.waitpid(pid, 0)
    else:
        os._exit(0)


def pair_cell(mode: str, runs: int, graph: Path = MODEL) -> float:
    """Mean of the two processes' CPU per run."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--runs", str(runs), "--graph", str(graph)],
                         capture_output=True, text=True, check=True).stdout
    costs = [json.loads(line) for line in out.splitlines() if line.strip()]
    return statistics.fmean(costs)


def report(cells: dict[str, list[float]], rounds: int, runs: int) -> str:
    lines = [
        "# A b=8 MLP run's CPU once its weights have left the cache",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {rounds} rounds of {runs} runs per cell, medians; one intra-op "
        "thread; `.venv/bin/python bench/weights_cache_bench.py`",
        "",
        *median_rows("cell", "CPU µs per run", cells, 0),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--child", choices=("shared", "private"), help=argparse.SUPPRESS)
    parser.add_argument("--graph", type=Path, default=MODEL, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.runs, args.graph)
        return 0
    from geserve.backends.ge.shared_weights import packed_graph

    cells: dict[str, list[float]] = {}
    scratch = tempfile.TemporaryDirectory(prefix="weights-cache-")
    mapped = packed_graph(MODEL, MODEL, "bench", _options, Path(scratch.name))
    assert mapped is not None
    for _ in range(args.rounds):
        for label, cost in single_cells(args.runs).items():
            cells.setdefault(label, []).append(cost)
        for mode, label in (("private", "two processes, 1 ms gaps, a session each"),
                            ("shared", "two processes, 1 ms gaps, one session's pages (forked)")):
            cells.setdefault(label, []).append(pair_cell(mode, args.runs))
        label = "two processes, 1 ms gaps, a session each, prepacked weights mapped from one file"
        cells.setdefault(label, []).append(pair_cell("private", args.runs, mapped))
    scratch.cleanup()
    text = report(cells, args.rounds, args.runs)
    print(text)
    (ROOT / "bench" / "results" / "weights_cache.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
