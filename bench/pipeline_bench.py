"""The image pipeline (bytes -> Python preprocess -> EfficientNet-Lite0 -> Python top-5) on geserve vs the real Triton.

Both servers run the same ensemble and the same Python models (examples/pipelines/); geserve runs the EfficientNet
step on its GE backend, Triton as a Python-backend ONNX Runtime model with the same intra-op thread count
(tests/support/pipelines.py:triton_repository). perf_analyzer sends the chelsea photo as JPEG bytes over HTTP at
concurrency 1 and 8, the servers alternating over rounds; medians go to bench/results/pipeline_bench.{md,json}
and the targets of issue 7 (geserve at least 1.5x Triton's throughput, lower p50 latency) are checked.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import tritonclient.http as httpclient
from google.protobuf import text_format

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import (  # noqa: E402
    Point,
    ensure_installed,
    geserve_session,
    machine,
    others_share,
    read_csv_point,
    versions,
)

from geserve.devices import threads_per_instance  # noqa: E402
from tests.support import reference  # noqa: E402
from tests.support.pipelines import load_config, photo_bytes, triton_repository  # noqa: E402
from tests.support.server import geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples" / "model_repository"
PIPELINE = "image_pipeline"
MODEL = "efficientnet_lite0"  # the pipeline's GE step
SYSTEMS = ("geserve", "triton")
CONCURRENCIES = (1, 8)
CATS = {"tiger cat", "Egyptian cat", "tabby, tabby cat"}


@dataclass(frozen=True)
class Mode:
    rounds: int
    window_ms: int
    stability: int
    max_trials: int


FULL = Mode(rounds=3, window_ms=4000, stability=15, max_trials=8)
QUICK = Mode(rounds=1, window_ms=2000, stability=30, max_trials=5)


def perf_analyzer_input(path: Path) -> Path:
    """--input-data JSON: one chelsea JPEG as the IMAGE element. perf_analyzer sends a BYTES tensor's `b64`
    content as it is on the wire, so it holds the element's 4-byte little-endian length, then the bytes."""
    photo = photo_bytes("chelsea")
    element = len(photo).to_bytes(4, "little") + photo
    path.write_text(json.dumps({"data": [{"IMAGE": {"b64": base64.b64encode(element).decode()}}]}))
    return path


def in_process_chain(threads: int, budget_s: float) -> Point:
    """The pipeline's three steps called one after the other in one process, no server: what c=1 could reach.

    The steps' own code (the Python models' functions, EfficientNet in a session with geserve's options).
    """
    import geserve.backends.python  # noqa: F401 - registers triton_python_backend_utils for the models' imports

    def step(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / name / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module

    preprocess, top5 = step("image_preprocess"), step("imagenet_top5")
    labels = np.array([line.encode() for line in (EXAMPLES / "imagenet_top5" / "labels.txt").read_text().split("\n")
                       if line], dtype=np.object_)
    session = geserve_session(EXAMPLES / "efficientnet_lite0" / "1" / "model.onnx", threads)
    photo = photo_bytes("chelsea")

    def run() -> None:
        pixels = preprocess.preprocess(photo)[np.newaxis]
        top5.top_classes(session.run(None, {"input": pixels})[0], labels)

    for _ in range(20):
        run()
    samples: list[float] = []
    stop = time.perf_counter() + budget_s
    while time.perf_counter() < stop:
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    micros = np.array(samples) * 1e6
    return Point(len(samples) / sum(samples), float(np.percentile(micros, 50)), float(np.percentile(micros, 99)))


def in_child(threads: int, budget_s: float) -> Point:
    """in_process_chain in a fresh process, so its threads never compete with a server."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(in_process_chain, threads, budget_s).result()


def pipeline_repository(dest: Path, batching: bool) -> Path:
    """Links to the pipeline's models in the example repository; with ``batching``, EfficientNet gets
    `dynamic_batching {}` (its folder's files linked, its config rewritten). Both servers are built from it."""
    dest.mkdir(parents=True)
    steps = [step.model_name for step in load_config(EXAMPLES / PIPELINE).ensemble_scheduling.step]
    for name in (PIPELINE, *steps):
        if not (batching and name == MODEL):
            (dest / name).symlink_to(EXAMPLES / name, target_is_directory=True)
            continue
        (dest / name).mkdir()
        for item in (EXAMPLES / name).iterdir():
            if item.name != "config.pbtxt":
                (dest / name / item.name).symlink_to(item, target_is_directory=item.is_dir())
        config = load_config(EXAMPLES / name)
        config.dynamic_batching.SetInParent()
        (dest / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    return dest


def check_and_warm(url: str, system: str) -> None:
    """The server answers correctly (the cat is a cat), and first-call costs stay out of the windows."""
    with httpclient.InferenceServerClient(url) as client:
        tensor = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[photo_bytes("chelsea")]], dtype=np.object_))
        for _ in range(10):
            labels = client.infer(PIPELINE, [tensor]).as_numpy("LABELS")
        top = labels[0][0].decode()
        if top not in CATS:
            raise SystemExit(f"{system}: the image pipeline answered {top!r} for the cat")


def measure(url: str, concurrency: int, data: Path, mode: Mode, csv_path: Path) -> tuple[Point | None, list[str]]:
    args = [
        "-m", PIPELINE, "-u", url, "-i", "http", "--input-data", str(data),
        "--concurrency-range", str(concurrency), "--measurement-interval", str(mode.window_ms),
        "--stability-percentage", str(mode.stability), "--max-trials", str(mode.max_trials), "-f", str(csv_path),
    ]  # fmt: skip
    result = reference.run_perf_analyzer(args, timeout=60 + 3 * mode.max_trials * mode.window_ms / 1000)
    point = read_csv_point(csv_path)
    if point is None:
        print(f"  perf_analyzer gave no result: {(result.stdout + result.stderr)[-800:]}", file=sys.stderr)
    return point, ["perf_analyzer", *args[:-2]]


def median(points: list[Point]) -> Point:
    return Point(*(statistics.median(getattr(p, f) for p in points) for f in ("throughput", "p50_us", "p99_us")))


def report(cells: dict[str, dict[int, list[Point]]], chain: list[Point], others: dict[str, list[float]],
           meta: dict[str, object], commands: dict[str, list[str]]) -> tuple[str, list[tuple[str, bool]]]:
    medians = {system: {c: median(points) for c, points in by_c.items() if points} for system, by_c in cells.items()}
    lines = ["| system | c | infer/s | p50 ms | p99 ms | others' CPU |", "|---|---:|---:|---:|---:|---:|"]
    if chain:
        p = median(chain)
        lines.append(f"| in-process chain, no server | 1 | {p.throughput:.1f} | {p.p50_us / 1000:.2f} "
                     f"| {p.p99_us / 1000:.2f} | {max(others.get('chain', [0.0])):.0%} |")
    for system in SYSTEMS:
        for c, p in sorted(medians.get(system, {}).items()):
            share = max(others.get(f"{system} c={c}", [0.0]))
            lines.append(f"| {system} | {c} | {p.throughput:.1f} | {p.p50_us / 1000:.2f} | {p.p99_us / 1000:.2f} "
                         f"| {share:.0%} |")
    targets = []
    for c in CONCURRENCIES:
        g, t = medians.get("geserve", {}).get(c), medians.get("triton", {}).get(c)
        if g is None or t is None:
            targets.append((f"c={c}: not measured", False))
            continue
        speedup = g.throughput / t.throughput
        targets.append((f"c={c}: throughput {g.throughput:.1f} vs {t.throughput:.1f} infer/s = {speedup:.2f}x "
                        "(target at least 1.5x)", speedup >= 1.5))
        targets.append((f"c={c}: p50 {g.p50_us / 1000:.2f} vs {t.p50_us / 1000:.2f} ms (target lower)",
                        g.p50_us < t.p50_us))
    verdicts = [f"- **{'PASS' if ok else 'FAIL'}** {text}" for text, ok in targets]
    t1 = medians.get("triton", {}).get(1)
    if chain and t1:
        ceiling = median(chain).throughput / t1.throughput
        verdicts.append(f"- c=1 ceiling: the in-process chain (no server at all) runs at {ceiling:.2f}x Triton's c=1 "
                        "throughput; one request at a time, no server can do better than that.")
    text = (
        "# Image pipeline: geserve vs Triton (pipeline_bench)\n\n"
        f"{meta['date']}, {meta['rounds']} alternating round(s), medians shown; {meta['machine']}; load average "
        f"{meta['load_before']} before, {meta['load_after']} after. Run time {meta['seconds']:.0f} s: "
        f"`{meta['command']}`\n\n"
        "`image_pipeline`: IMAGE (JPEG bytes) -> image_preprocess (Python, Pillow) -> efficientnet_lite0 -> "
        "imagenet_top5 (Python). The in-process chain calls the three steps' code one after the other in one "
        "process, without a server (what one request at a time could reach). geserve runs the Python steps "
        "in-process and EfficientNet on its GE backend; "
        "Triton 2.51 runs the same Python models in its Python-backend stubs and EfficientNet as a Python-backend "
        f"ONNX Runtime model. ONNX Runtime intra-op threads: {meta['ort_threads']} on both. EfficientNet step: "
        + ("with `dynamic_batching {}` on both servers (`--batching`)" if meta["efficientnet_batching"]
           else "as configured in the example repository (no dynamic batching)") + ".\n\n"
        + "\n".join(lines) + "\n\n## Targets (issue 7)\n\n" + "\n".join(verdicts) + "\n\n"
        "## Versions\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta["versions"].items()) + "\n\n"  # type: ignore[union-attr]
        "## How it was measured\n\n"
        "perf_analyzer over HTTP, `--input-data` holding the chelsea photo as JPEG "
        f"({meta['image_bytes']} bytes), one run per system and concurrency, `--stability-percentage "
        f"{meta['stability']}`, windows of {meta['window_ms']} ms; both servers run for the whole benchmark, only one "
        "is driven at a time, the order swapped each round. others' CPU: the largest share of the machine's CPUs "
        "used by processes outside the benchmark during a cell, over the rounds.\n\n"
        "```\n" + "\n".join(f"# {name}\n{' '.join(cmd)}" for name, cmd in commands.items()) + "\n```\n"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "pipeline_bench_batching" if meta["efficientnet_batching"] else "pipeline_bench"
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({
        "meta": meta,
        "medians": {s: {str(c): asdict(p) for c, p in by_c.items()} for s, by_c in medians.items()},
        "samples": {s: {str(c): [asdict(p) for p in pts] for c, pts in by_c.items()} for s, by_c in cells.items()},
        "in_process_chain": [asdict(p) for p in chain],
        "others_cpu_share": others,
        "targets": [{"target": t, "passed": ok} for t, ok in targets],
        "commands": commands,
    }, indent=1))
    return "\n".join(lines) + "\n\n" + "\n".join(verdicts), targets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, shorter windows")
    parser.add_argument("--rounds", type=int, help="override the number of alternating rounds")
    parser.add_argument("--batching", action="store_true",
                        help=f"serve {MODEL} with dynamic_batching {{}} on both servers (as configured: without)")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if args.rounds:
        mode = Mode(**{**asdict(mode), "rounds": args.rounds})
    started, load_before = time.monotonic(), os.getloadavg()
    ensure_installed([PIPELINE])
    threads = threads_per_instance(1)
    os.environ[reference.ORT_THREADS_ENV] = str(threads)  # Triton's ONNX Runtime step: geserve's thread count
    cells: dict[str, dict[int, list[Point]]] = {system: {c: [] for c in CONCURRENCIES} for system in SYSTEMS}
    chain: list[Point] = []
    others: dict[str, list[float]] = {}
    commands: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        data = perf_analyzer_input(root / "chelsea.json")
        RESULTS.mkdir(parents=True, exist_ok=True)
        log = RESULTS / "pipeline_bench.geserve.log"
        source = pipeline_repository(root / "source", args.batching)
        server = stack.enter_context(geserve([source], log))
        commands["geserve"] = [str(a) for a in server.process.args]  # type: ignore[union-attr]
        triton_repo = triton_repository(source, root / "triton", [PIPELINE])
        triton_url = stack.enter_context(
            reference.reference_triton(triton_repo, RESULTS, timeout=180, log_name="pipeline_bench.triton")
        )
        urls = {"geserve": f"127.0.0.1:{server.http_port}",
                "triton": triton_url.removeprefix("http://")}
        for system, url in urls.items():
            check_and_warm(url, system)
        for round_index in range(mode.rounds):
            order = SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]
            print(f"round {round_index + 1}/{mode.rounds}", flush=True)
            with others_share() as share:
                chain.append(in_child(threads, mode.window_ms / 1000))
            others.setdefault("chain", []).append(share[0])
            print(f"  in-process chain: {chain[-1].throughput:.1f}/s p50 {chain[-1].p50_us / 1000:.2f} ms "
                  f"(others' CPU {share[0]:.0%})", flush=True)
            for system in order:
                for c in CONCURRENCIES:
                    with others_share() as share:
                        point, commands[f"{system} c={c}"] = measure(urls[system], c, data, mode,
                                                                     root / f"{system}-{c}-{round_index}.csv")
                    others.setdefault(f"{system} c={c}", []).append(share[0])
                    if point is not None:
                        cells[system][c].append(point)
                        print(f"  {system} c={c}: {point.throughput:.1f}/s p50 {point.p50_us / 1000:.2f} ms "
                              f"(others' CPU {share[0]:.0%})", flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(), "rounds": mode.rounds,
        "efficientnet_batching": args.batching,
        "window_ms": mode.window_ms, "stability": mode.stability, "ort_threads": threads,
        "load_before": " / ".join(f"{x:.2f}" for x in load_before),
        "load_after": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "seconds": time.monotonic() - started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "image_bytes": len(photo_bytes("chelsea")), "versions": versions(),
    }  # fmt: skip
    table, targets = report(cells, chain, others, meta, commands)
    print(table)
    return 0 if all(ok for _, ok in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
