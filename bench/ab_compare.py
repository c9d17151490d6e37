"""A/B of two geserve commits on the MLP: the working tree against a baseline commit, alternating rounds.

Both servers run side by side (the baseline from a temporary git worktree), each serving the example MLP as
configured and with dynamic batching, and only one is driven at a time by perf_analyzer (harness.py's
settings): HTTP c=1 (p50), HTTP c=16, HTTP c=16 with dynamic batching, gRPC c=16 (throughput). The order of the
two systems alternates each round; the report gives each cell's median and the new/old ratio, and the server's
CPU per inference in each cell (its whole process tree, from /proc, over its inference count): steadier than
throughput on this VM, so the table to read for small cuts. Writes bench/results/ab_compare.md and
ab_compare.json.
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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
from harness import FULL, QUICK, Endpoint, Mode, Point, Samples  # noqa: E402

from geserve.tune.machine import tree_cpu_s  # noqa: E402
from tests.support.reference import free_port  # noqa: E402
from tests.support.server import RunningServer, _wait_live, stop_geserve  # noqa: E402

MODEL = "mlp"
DEFAULT_BASELINE = "94d45be"  # the last commit before issue 11's reshaping
# (label, protocol, model suffix, concurrency, what the cell reports)
CELLS = (
    ("HTTP c=1 p50 (µs)", "http", "", 1, "p50"),
    ("HTTP c=16 (infer/s)", "http", "", 16, "throughput"),
    ("HTTP c=16 + dynamic batching (infer/s)", "http", harness.DB_SUFFIX, 16, "throughput"),
    ("gRPC c=16 (infer/s)", "grpc", "", 16, "throughput"),
)


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ab-baseline-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False,
                           capture_output=True)


@contextmanager
def serve(tree: Path, repo: Path, log_path: Path) -> Iterator[RunningServer]:
    """`geserve serve` from `tree`'s sources (its own directory first on the module path)."""
    http_port, grpc_port = free_port(), free_port()
    args = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(repo), "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--metrics-port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env)
    server = RunningServer(process, http_port, log_path, grpc_port)
    try:
        _wait_live(server, 60)
        yield server
    finally:
        stop_geserve(server)


def endpoints(server: RunningServer, system: str) -> dict[str, Endpoint]:
    http = f"127.0.0.1:{server.http_port}"
    return {
        "http": Endpoint(system, "http", http, http),
        "grpc": Endpoint(system, "grpc", f"127.0.0.1:{server.grpc_port}", http),
    }


def measure(server: RunningServer, eps: dict[str, Endpoint], mode: Mode, samples: Samples) -> dict[str, float | None]:
    """Each cell's figure, and under `cpu_label(cell)` the server's CPU µs per inference during its run."""
    values: dict[str, float | None] = {}
    for label, protocol, suffix, concurrency, field in CELLS:
        endpoint = eps[protocol]
        if suffix:
            endpoint = Endpoint(endpoint.system, protocol, endpoint.url, endpoint.http_url, suffix)
        model = MODEL + endpoint.model_suffix
        count, cpu = harness.served_count(endpoint.http_url, model), tree_cpu_s(server.process.pid)
        point: Point | None = harness.perf_analyzer(endpoint, MODEL, concurrency, mode.window_ms, mode, samples)
        cpu, count = tree_cpu_s(server.process.pid) - cpu, harness.served_count(endpoint.http_url, model) - count
        values[label] = None if point is None else getattr(point, "p50_us" if field == "p50" else field)
        values[cpu_label(label)] = cpu / count * 1e6 if count else None
    return values


def cpu_label(label: str) -> str:
    return f"{label.split(' (')[0]}: server CPU µs/inf"


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(rounds: dict[str, list[dict[str, float | None]]], baseline: str, current: str, mode: Mode) -> str:
    lines = [
        "# A/B: geserve baseline vs working tree (MLP, perf_analyzer)",
        "",
        f"Baseline `{baseline}`, new `{current}`; {len(rounds['old'])} alternating rounds, median per cell; "
        f"perf_analyzer window {mode.window_ms} ms, stability {mode.stability}%. Date: {time.strftime('%Y-%m-%d')}.",
        "",
        "| cell | baseline | new | new / baseline | rounds (baseline) | rounds (new) |",
        "|---|---:|---:|---:|---|---|",
    ]
    for label in [cell[0] for cell in CELLS] + [cpu_label(cell[0]) for cell in CELLS]:
        old = median([r[label] for r in rounds["old"]])
        new = median([r[label] for r in rounds["new"]])
        ratio = f"{new / old:.2f}" if old and new else "n/a"
        each = {k: ", ".join("-" if r[label] is None else f"{r[label]:.0f}" for r in rounds[k]) for k in rounds}
        lines.append(f"| {label} | {old or 0:.0f} | {new or 0:.0f} | {ratio} | {each['old']} | {each['new']} |")
    lines += ["", "For p50 and CPU a ratio under 1 is better; for throughput, over 1. "
              "This VM moves ±15-30% between runs."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="short perf_analyzer windows")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    harness.ensure_installed([MODEL])
    current = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip() + "+tree"
    samples = Samples()
    rounds: dict[str, list[dict[str, float | None]]] = {"old": [], "new": []}
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="ab-repo-") as tmp:
        repo = harness.model_repository([MODEL], Path(tmp) / "repo")
        tree = stack.enter_context(worktree(args.baseline))
        servers = {
            "old": stack.enter_context(serve(tree, repo, harness.RESULTS / "ab_compare.old.log")),
            "new": stack.enter_context(serve(ROOT, repo, harness.RESULTS / "ab_compare.new.log")),
        }
        eps = {name: endpoints(server, name) for name, server in servers.items()}
        config = harness.load_config(harness.EXAMPLES / MODEL)
        for name in eps:
            harness.warm_up(eps[name]["http"], MODEL, config)
            harness.warm_up(Endpoint(name, "http", eps[name]["http"].url, "", harness.DB_SUFFIX), MODEL, config)
        for index in range(args.rounds):
            order = ("old", "new") if index % 2 == 0 else ("new", "old")
            for name in order:
                print(f"round {index + 1}: {name}", file=sys.stderr)
                rounds[name].append(measure(servers[name], eps[name], mode, samples))
    text = report(rounds, args.baseline, current, mode)
    print(text)
    (harness.RESULTS / "ab_compare.md").write_text(text)
    (harness.RESULTS / "ab_compare.json").write_text(json.dumps(
        {"baseline": args.baseline, "new": current, "rounds": rounds, "commands": samples.commands}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
