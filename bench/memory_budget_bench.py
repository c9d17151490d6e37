"""Issue 34's benchmark: 100 models where memory holds 20 % of them, geserve with `--model-memory-budget` and
`--load-on-demand` against the real Triton with the 20 most popular models preloaded (what its users do today).

The models: 80 copies of examples' MLP (256->1024->1024->10, 5 MiB) and 20 of its MiniLM (all-MiniLM-L6-v2, 90 MiB),
each copy its own file (so that no two models share weights), ranked in a random order and requested with Zipf(1.1)
popularity: p(rank k) ~ k^-1.1. Arrivals are open loop (a Poisson process at `--rate`; each request is sent at its
time whether or not the earlier ones were answered) from tritonclient's asyncio HTTP client; an MLP request is one
row of 256 features, a MiniLM request one sentence of 16 tokens.

geserve: two workers, explicit control mode, nothing loaded at start, the budget 20 % of what the 100 models' files
hold together (every version is charged what it measures: the table gives the budget against the measured charges).
After `--warmup` seconds of the same traffic, `--duration` seconds are measured. A request is a hit when its model
was serving when it was sent, and cold otherwise (it waited for a load, its own or one under way): from the server's
log, where each load ends ("successfully loaded", both workers) and each eviction starts ("evicting model").
Reported: hit ratio, p50 / p99 of hits and of cold requests, loads per second, the process tree's peak PSS (sampled
every 100 ms) against the budget and the server's PSS before any model loaded.

Triton 2.51 (the nvidia-pytriton wheel, no ONNX Runtime backend: each model is the Python-backend wrapper of
tests/support/reference.py running the same ONNX file on one thread) in explicit mode with the 20 most popular models
loaded at start, then the same arrivals for `--duration` seconds: its error rate (a request for a model it does not
serve is refused), the p50 / p99 of its answers and its peak PSS (server and Python stubs).

Writes bench/results/memory_budget.md. Run it alone on the machine:
  flock -x /tmp/geserve-cpu.lock .venv/bin/python bench/memory_budget_bench.py [--rate 10] [--duration 90]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import EXAMPLES, RESULTS
from tests.support import reference
from tests.support.budget_models import PeakPss, samples, tree_pss, zipf
from tests.support.server import RunningServer, geserve

MLPS, MINILMS = 80, 20
EXPONENT = 1.1
SHARE = 0.2  # of the models' files the budget holds
WORKERS = 2
TOKENS = 16
MIB = 1 << 20
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_LOADED = re.compile(r"successfully loaded '([^']+)' version")
_EVICTED = re.compile(r"evicting model '([^']+)'")


@dataclass(frozen=True)
class Shot:
    model: str
    sent: float  # time.time()
    latency: float  # seconds
    error: str = ""


@dataclass
class Outcome:
    shots: list[Shot]
    peak_pss: int
    base_pss: int = 0
    hits: list[float] = field(default_factory=list)  # latencies (s) of the requests whose model was serving
    cold: list[float] = field(default_factory=list)  # and of the others
    loads: int = 0


# ---- the models and the traffic ---------------------------------------------------------------------


def build_repository(dest: Path) -> list[str]:
    """The 100 models, each a copy of an example's file under its own name; their names."""
    names = [f"mlp_{i:02d}" for i in range(MLPS)] + [f"minilm_{i:02d}" for i in range(MINILMS)]
    for name in names:
        example = EXAMPLES / name.split("_")[0]
        (dest / name / "1").mkdir(parents=True)
        shutil.copyfile(example / "1" / "model.onnx", dest / name / "1" / "model.onnx")
        config = (example / "config.pbtxt").read_text()
        (dest / name / "config.pbtxt").write_text(re.sub(r'name: "[^"]+"', f'name: "{name}"', config, count=1))
    return names


def files_size(repo: Path, names: list[str]) -> int:
    return sum((repo / n / "1" / "model.onnx").stat().st_size for n in names)


def ranking(names: list[str], seed: int) -> list[str]:
    """The models, most popular first: a random order."""
    return [names[i] for i in np.random.default_rng(seed).permutation(len(names))]


def plan(ranked: list[str], rate: float, seconds: float, seed: int) -> list[tuple[float, str]]:
    """(offset in seconds, model) of every arrival: Poisson at `rate`, models by Zipf popularity of their rank."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, int(rate * seconds * 1.5) + 10)
    offsets = np.cumsum(gaps)
    offsets = offsets[offsets < seconds]
    picks = rng.choice(len(ranked), size=len(offsets), p=zipf(len(ranked), EXPONENT))
    return [(float(t), ranked[k]) for t, k in zip(offsets, picks, strict=True)]


def inputs(model: str) -> list[httpclient.InferInput]:
    if model.startswith("mlp"):
        tensor = httpclient.InferInput("input", [1, 256], "FP32")
        tensor.set_data_from_numpy(np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32))
        return [tensor]
    ids = np.random.default_rng(0).integers(1000, 20000, (1, TOKENS)).astype(np.int64)
    tensors = [httpclient.InferInput("input_ids", [1, TOKENS], "INT64"),
               httpclient.InferInput("attention_mask", [1, TOKENS], "INT64")]
    tensors[0].set_data_from_numpy(ids)
    tensors[1].set_data_from_numpy(np.ones_like(ids))
    return tensors


async def fire(url: str, arrivals: list[tuple[float, str]]) -> list[Shot]:
    """Send every arrival at its time (open loop); each one's outcome."""
    client = aioclient.InferenceServerClient(url, conn_limit=256, conn_timeout=300)
    feeds = {m: inputs(m) for m in {m for _, m in arrivals}}
    start = time.monotonic()
    wall = time.time() - start

    async def one(offset: float, model: str) -> Shot:
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        sent = time.monotonic()
        try:
            await client.infer(model, feeds[model])
        except Exception as exc:  # an answer with an error: what the table counts
            return Shot(model, wall + sent, time.monotonic() - sent, str(exc)[:120] or type(exc).__name__)
        return Shot(model, wall + sent, time.monotonic() - sent)

    try:
        return list(await asyncio.gather(*(one(t, m) for t, m in arrivals)))
    finally:
        await client.close()


# ---- geserve ---------------------------------------------------------------------------------------


def serving_intervals(log: str, workers: int) -> dict[str, list[tuple[float, float]]]:
    """When each model served on every worker: from the end of its load to the start of its eviction (wall time)."""
    intervals: dict[str, list[tuple[float, float]]] = {}
    loaded: dict[str, int] = {}
    since: dict[str, float] = {}
    for line in log.splitlines():
        stamp = _LOG_TIME.match(line)
        if stamp is None:
            continue
        when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if (match := _LOADED.search(line)) is not None:
            name = match.group(1)
            loaded[name] = loaded.get(name, 0) + 1
            if loaded[name] == workers:
                since[name] = when
        elif (match := _EVICTED.search(line)) is not None:
            name = match.group(1)
            if name in since:
                intervals.setdefault(name, []).append((since.pop(name), when))
            loaded[name] = 0
    for name, start in since.items():
        intervals.setdefault(name, []).append((start, float("inf")))
    return intervals


def is_hit(shot: Shot, intervals: dict[str, list[tuple[float, float]]]) -> bool:
    return any(start <= shot.sent < end for start, end in intervals.get(shot.model, ()))


def metrics(server: RunningServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as answer:
        return answer.read().decode()


def run_geserve(repo: Path, budget: int, warmup: list[tuple[float, str]], measured: list[tuple[float, str]],
                logs: Path) -> Outcome:
    args = ["--model-control-mode", "explicit", "--load-on-demand", "--model-memory-budget", str(budget),
            "--workers", str(WORKERS), "--log-verbose", "0"]
    with geserve([repo], logs / "memory_budget.geserve.log", args) as server:
        wait_ready(server.base)
        time.sleep(1.0)
        base = tree_pss(server.process.pid)
        sampler = PeakPss(server.process.pid, 0.1)
        asyncio.run(fire(server.url, warmup))
        before = samples(metrics(server), "ge_model_load_on_demand_total")
        shots = asyncio.run(fire(server.url, measured))
        text = metrics(server)
        peak = sampler.stop()
        log = server.log()
    loads = int(sum(samples(text, "ge_model_load_on_demand_total").values()) - sum(before.values()))
    intervals = serving_intervals(log, WORKERS)
    answered = [s for s in shots if not s.error]
    hits = [s.latency for s in answered if is_hit(s, intervals)]
    cold = [s.latency for s in answered if not is_hit(s, intervals)]
    return Outcome(shots, peak, base, hits, cold, loads)


def wait_ready(base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{base} not ready within {timeout} s")


def all_charges(repo: Path, names: list[str], logs: Path) -> dict[str, int]:
    """What each model costs when loaded (one load each, under an unlimited budget, two at a time)."""
    args = ["--model-control-mode", "explicit", "--model-memory-budget", "64GiB", "--workers", str(WORKERS)]
    charges: dict[str, int] = {}
    with geserve([repo], logs / "memory_budget.charges.log", args) as server:
        wait_ready(server.base)
        time.sleep(1.0)
        client = httpclient.InferenceServerClient(server.url, network_timeout=300)
        for name in names:
            client.load_model(name)
            found = samples(metrics(server), "ge_model_memory_bytes")
            charges.update({key.split('"')[1]: int(value) for key, value in found.items()})
            client.unload_model(name)
    return charges


# ---- Triton -------------------------------------------------------------------------------------------


def run_triton(repo: Path, names: list[str], preload: list[str], measured: list[tuple[float, str]],
               tmp: Path) -> Outcome:
    triton_repo = reference.build_python_backend_repository(repo, tmp / "triton", names)
    os.environ[reference.ORT_THREADS_ENV] = "1"
    triton = reference.BootingTriton(triton_repo, RESULTS, timeout=600, log_name="memory_budget.triton",
                                     model_control_mode="explicit", load_models=preload)
    try:
        triton.wait()
        time.sleep(1.0)
        sampler = PeakPss(triton.process.pid, 0.1)
        shots = asyncio.run(fire(triton.http, measured))
        return Outcome(shots, sampler.stop(), 0)
    finally:
        triton.stop()


# ---- the table ----------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    p50, p99 = np.percentile(np.array(values) * 1000, [50, 99])
    return f"{p50:.1f} / {p99:.1f}"


def report(args: argparse.Namespace, budget: int, charges: dict[str, int], ours: Outcome,
           theirs: Outcome | None) -> str:
    lines = [*_heading(args, budget, charges), _geserve_row(ours, args.duration)]
    if theirs is not None:
        lines.append(_triton_row(theirs))
    lines += _notes(budget, ours, theirs)
    return "\n".join(lines) + "\n"


def _heading(args: argparse.Namespace, budget: int, charges: dict[str, int]) -> list[str]:
    mlp = np.median([v for k, v in charges.items() if k.startswith("mlp")])
    minilm = np.median([v for k, v in charges.items() if k.startswith("minilm")])
    total = sum(charges.values())
    return [
        "# Memory budget: 100 models, memory for 20 % of them",
        "",
        f"`.venv/bin/python bench/memory_budget_bench.py --rate {args.rate:g} --duration {args.duration:g} "
        f"--warmup {args.warmup:g}`, {time.strftime('%Y-%m-%d')}; 2 vCPU. {MLPS} MLP (5 MiB) and {MINILMS} MiniLM "
        f"(90 MiB) models, Zipf({EXPONENT}) popularity, open-loop Poisson arrivals at {args.rate:g}/s.",
        "",
        f"Budget {budget / MIB:.0f} MiB: {budget / total * 100:.1f} % of what the 100 models measure together "
        f"({total / MIB:.0f} MiB: MLP {mlp / MIB:.1f} MiB, MiniLM {minilm / MIB:.1f} MiB each, two workers together).",
        "",
        "| server | requests | errors | hit ratio | hits p50 / p99 (ms) | cold p50 / p99 (ms) | loads/s "
        "| peak PSS (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]


def _triton_row(theirs: Outcome) -> str:
    errors = [s for s in theirs.shots if s.error]
    answered = [s.latency for s in theirs.shots if not s.error]
    return (
        f"| Triton 2.51, 20 most popular preloaded | {len(theirs.shots)} | {len(errors)} "
        f"({len(errors) / max(len(theirs.shots), 1) * 100:.1f} %) | - | {percentiles(answered)} | - | 0 | "
        f"{theirs.peak_pss / MIB:.0f} |"
    )


def _notes(budget: int, ours: Outcome, theirs: Outcome | None) -> list[str]:
    over = ours.peak_pss - ours.base_pss - budget
    lines = [
        "",
        f"geserve's peak PSS against its budget: {ours.peak_pss / MIB:.0f} MiB = base {ours.base_pss / MIB:.0f} MiB "
        f"(two workers and the supervisor, no model) + budget {budget / MIB:.0f} MiB + {over / MIB:.0f} MiB "
        f"({(ours.peak_pss / (ours.base_pss + budget) - 1) * 100:+.1f} % of base + budget).",
    ]
    first = next((s.error for s in ours.shots if s.error), "")
    if first:
        lines += ["", f"geserve's first error: `{first}`"]
    refusal = next((s.error for s in theirs.shots if s.error), "") if theirs is not None else ""
    if refusal:
        lines += ["", f"Triton's refusal of a model it does not serve: `{refusal}`"]
    return lines


def _geserve_row(ours: Outcome, duration: float) -> str:
    errors = [s for s in ours.shots if s.error]
    answered = len(ours.hits) + len(ours.cold)
    return (
        f"| geserve, budget + load on demand | {len(ours.shots)} | {len(errors)} | "
        f"{len(ours.hits) / max(answered, 1) * 100:.1f} % | {percentiles(ours.hits)} | {percentiles(ours.cold)} | "
        f"{ours.loads / duration:.2f} | {ours.peak_pss / MIB:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds measured")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of geserve traffic before measuring")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--no-triton", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="geserve-budget-bench-") as tmp:
        root = Path(tmp)
        os.environ["GESERVE_CACHE_DIR"] = str(root / "cache")  # the packed weights of 100 fresh copies
        repo = root / "models"
        names = build_repository(repo)
        budget = int(files_size(repo, names) * SHARE)
        charges = all_charges(repo, names, RESULTS)
        ranked = ranking(names, args.seed)
        warmup = plan(ranked, args.rate, args.warmup, args.seed + 1)
        measured = plan(ranked, args.rate, args.duration, args.seed + 2)
        ours = run_geserve(repo, budget, warmup, measured, RESULTS)
        theirs = None
        if not args.no_triton and (reason := reference.reference_unavailable_reason()) is None:
            theirs = run_triton(repo, names, ranked[: len(names) // 5], measured, root)
        elif not args.no_triton:
            print(f"Triton skipped: {reason}")
        text = report(args, budget, charges, ours, theirs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_budget.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
