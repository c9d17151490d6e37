"""The response cache on ResNet-50: a cache hit against a miss against no cache, perf_analyzer over HTTP.

One geserve process serves the example ResNet-50 twice (symlinked model file): `resnet50` as configured and
`resnet50_cached` with `response_cache { enable: true }`, under `--cache-config local,size=<bytes>` sized for one
ResNet-50 answer. Three cases, driven one at a time in alternating rounds (the order rotates each round):

- no cache: `resnet50`, 16 different images that perf_analyzer cycles through (`--input-data` JSON, base64);
- hit: `resnet50_cached`, one all-zero image repeated (`--input-data zero`): after the first request every one is
  answered from the cache (the key hashes the 602 KB input on every request; the model never runs);
- miss: `resnet50_cached`, the same 16 images as no cache: with room for one entry, each request misses, runs the
  model, and evicts the previous answer.

Each row also shows what the server counted over the case's runs (hits, misses, executions, from `/v2/.../stats`)
and its mean lookup (hit) and lookup + insertion (miss) times. Writes bench/results/cache.md and cache.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geserve.service.response_cache import entry_size  # noqa: E402
from geserve.types import OutputTensor  # noqa: E402
from geserve.version import __version__  # noqa: E402
from tests.support.models import example_onnx  # noqa: E402
from tests.support.reference import run_perf_analyzer  # noqa: E402
from tests.support.server import RunningServer, geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
IMAGES = 16  # distinct inputs the miss case cycles through
SHAPE = (3, 224, 224)
CASES = ("no cache", "hit", "miss")


def _repository(folder: Path) -> Path:
    """`resnet50` and `resnet50_cached`, both on the example's ONNX file (symlinked)."""
    onnx_file = example_onnx("resnet50")
    config = (onnx_file.parents[1] / "config.pbtxt").read_text()
    for name, extra in (("resnet50", ""), ("resnet50_cached", "response_cache { enable: true }\n")):
        (folder / name / "1").mkdir(parents=True)
        (folder / name / "1" / "model.onnx").symlink_to(onnx_file)
        (folder / name / "config.pbtxt").write_text(config.replace('"resnet50"', f'"{name}"') + extra)
    return folder


def _distinct_images(path: Path) -> Path:
    """perf_analyzer input data: IMAGES different images (base64 of the FP32 bytes, one batch item each)."""
    rng = np.random.default_rng(0)
    data = [{"input": {"b64": base64.b64encode(rng.random(SHAPE, np.float32).tobytes()).decode()}}
            for _ in range(IMAGES)]
    path.write_text(json.dumps({"data": data}))
    return path


def _stats(server: RunningServer, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.base}/v2/models/{model}/stats", timeout=10) as response:
        stats: dict[str, Any] = json.loads(response.read())["model_stats"][0]
        return stats


def _counters(server: RunningServer, model: str) -> dict[str, int]:
    stats = _stats(server, model)
    inference = stats["inference_stats"]
    return {
        "hits": inference["cache_hit"]["count"], "hit_ns": inference["cache_hit"]["ns"],
        "misses": inference["cache_miss"]["count"], "miss_ns": inference["cache_miss"]["ns"],
        "executions": stats["execution_count"],
    }


def _perf_analyzer(url: str, model: str, input_data: str, concurrency: int, interval_ms: int) -> dict[str, Any]:
    """One perf_analyzer run; on a busy machine that never settles within 25%, once more accepting any spread
    over a window three times as long (what `unsettled` in the report counts)."""
    args = ["-m", model, "-u", url, "-i", "http", "--concurrency-range", str(concurrency),
            "--measurement-interval", str(interval_ms), "--stability-percentage", "25", "--max-trials", "10",
            "--input-data", input_data]
    result = run_perf_analyzer(args, timeout=900)
    output = result.stdout + result.stderr
    unsettled = result.returncode != 0 and "stable measurement" in output
    if unsettled:
        args[args.index("--stability-percentage") + 1] = "1000"
        args[args.index("--measurement-interval") + 1] = str(3 * interval_ms)
        result = run_perf_analyzer(args, timeout=900)
        output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(output[-3000:])
    return {
        "p50_us": float(re.search(r"p50 latency: (\d+) usec", output).group(1)),  # type: ignore[union-attr]
        "p99_us": float(re.search(r"p99 latency: (\d+) usec", output).group(1)),  # type: ignore[union-attr]
        "throughput": float(re.search(r"Throughput: ([\d.]+) infer/sec", output).group(1)),  # type: ignore[union-attr]
        "command": ["perf_analyzer", *args],
        "unsettled": unsettled,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one round, short windows")
    args = parser.parse_args()
    rounds, interval = (1, 2000) if args.quick else (args.rounds, 4000)
    # Room for one ResNet-50 answer (1000 FP32 logits and the entry's overhead), not two.
    one = entry_size([OutputTensor("logits", "FP32", (1, 1000), np.zeros((1, 1000), np.float32))])
    cache_size = one + one // 2
    samples: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    counted: dict[str, dict[str, int]] = {case: dict.fromkeys(("hits", "hit_ns", "misses", "miss_ns",
                                                              "executions"), 0) for case in CASES}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="cache_bench_") as scratch:
        repo = _repository(Path(scratch) / "models")
        images = str(_distinct_images(Path(scratch) / "images.json"))
        # No cache and miss send the same images, so that the cache is all that differs between them.
        inputs = {"no cache": ("resnet50", images), "hit": ("resnet50_cached", "zero"),
                  "miss": ("resnet50_cached", images)}
        log = RESULTS / "cache.server.log"  # git-ignored
        with geserve([repo], log, ["--cache-config", f"local,size={cache_size}"]) as server:
            for model in ("resnet50", "resnet50_cached"):  # warm both (and leave the zero image's answer cached)
                _perf_analyzer(server.url, model, "zero", 1, 1000)
            for index in range(rounds):
                order = CASES[index % 3:] + CASES[: index % 3]
                for case in order:
                    model, data = inputs[case]
                    before = _counters(server, model)
                    samples[case].append(_perf_analyzer(server.url, model, data, args.concurrency, interval))
                    after = _counters(server, model)
                    for key in counted[case]:
                        counted[case][key] += after[key] - before[key]
                    print(f"round {index + 1} {case}: p50 {samples[case][-1]['p50_us']:.0f} us, "
                          f"{samples[case][-1]['throughput']:.1f} infer/s", flush=True)

    load_after = os.getloadavg()[0]

    def med(case: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[case])

    rows = []
    for case in CASES:
        c = counted[case]
        lookup = f"{c['hit_ns'] / c['hits'] / 1000:.0f}" if c["hits"] else "-"
        miss = f"{c['miss_ns'] / c['misses'] / 1000:.0f}" if c["misses"] else "-"
        unsettled = sum(s["unsettled"] for s in samples[case])
        rows.append(f"| {case} | {med(case, 'p50_us'):.0f} | {med(case, 'p99_us'):.0f} | "
                    f"{med(case, 'throughput'):.1f} | {c['hits']} | {c['misses']} | {c['executions']} | "
                    f"{lookup} | {miss} | {unsettled}/{len(samples[case])} |")
    speedup = med("no cache", "p50_us") / med("hit", "p50_us")
    overhead = med("miss", "p50_us") - med("no cache", "p50_us")
    miss = counted["miss"]
    miss_cost = miss["miss_ns"] / miss["misses"] / 1000 if miss["misses"] else 0.0
    table = "\n".join([
        "| case | p50 µs | p99 µs | infer/s | hits | misses | executions | mean hit lookup µs | mean miss "
        "lookup + insert µs | unsettled runs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])
    print(table)
    print(f"hit p50 {speedup:.1f}x faster than no cache; miss p50 {overhead:+.0f} µs against no cache; the "
          f"server's own cost of a miss {miss_cost:.0f} µs")
    RESULTS.mkdir(parents=True, exist_ok=True)
    commands = {case: " ".join(samples[case][-1]["command"]).replace(scratch, "<tmp>") for case in CASES}
    (RESULTS / "cache.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": rounds, "concurrency": args.concurrency,
        "cache_size": cache_size, "samples": samples, "server_counts": counted, "geserve": __version__,
    }, indent=1, default=str).replace(scratch, "<tmp>"))
    report = RESULTS / "cache.md"
    report.write_text(
        f"# Response cache: ResNet-50, hit vs miss vs no cache (HTTP, perf_analyzer c={args.concurrency})\n\n"
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {rounds} alternating round(s), medians of the rounds shown; the "
        f"counts and mean times are the server's own over all rounds of a case.\n\n"
        f"{table}\n\n"
        f"- a hit answers {speedup:.1f}x faster (p50) than running the model. A miss costs the server "
        f"{miss_cost:.0f} µs (its own measure: the 602 KB input hashed, the 4 KB answer copied in); the p50 of "
        f"the miss case differs from no cache's by {overhead:+.0f} µs, which is the machine's noise whenever it "
        f"is larger than that\n"
        f"- `--cache-config local,size={cache_size}`: room for one ResNet-50 answer ({one} bytes counted), so the "
        f"miss case, cycling through {IMAGES} images, evicts on every request and never hits\n"
        f"- the hit case's misses: its first request of a round after the miss case, which evicted that image's "
        f"answer\n"
        f"- unsettled runs: perf_analyzer found no window within 25% of the others in 10 tries (a busy machine) "
        f"and was run again over a window three times as long, accepting its spread\n"
        f"- geserve {__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs; load average {load_before:.1f} before the run and "
        f"{load_after:.1f} after it (other processes shared the machine when it is above the CPU count)\n"
        + "".join(f"- {case}: `{commands[case]}`\n" for case in CASES)
    )
    print(f"written to {report.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
