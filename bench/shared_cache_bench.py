"""A response cache hit's cost with one process and with workers, through tritonclient over HTTP.

One geserve per worker count (`--workers-list`, default 1,2), each on a temporary repository with two cached models
(`response_cache { enable: true }`, `--cache-config local,size=64 MiB`): Triton's `simple` (two INT32 [1,16] inputs
and outputs) and an FP32 identity fed a 602 KB input (ResNet-50's input size), so a hit hands back 602 KB. Each
case sends the same request `--requests` times on one connection (after a warm-up; the first request stores the
answer, every later one is a hit) and reports the client's median and p90 per request and the server's own mean
`success` and `cache_hit` times per hit over those requests (`/v2/models/<m>/stats`: `cache_hit` is hashing the
request and looking it up). Servers run one after the other, in alternating rounds (`--rounds`).

Run it from each tree to compare two versions (as http_path_bench.py); on one worker, the shared cache of
`--workers N` is compared with one process's in-process cache by the same table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.support import models  # noqa: E402
from tests.support.server import geserve  # noqa: E402

CACHED = "response_cache { enable: true }"
BIG = 150528  # FP32 elements: 602 KB


def _cases() -> list[tuple[str, str, list[httpclient.InferInput]]]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    small = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    small[0].set_data_from_numpy(a)
    small[1].set_data_from_numpy(a)
    big = [httpclient.InferInput("INPUT0", [1, BIG], "FP32")]
    big[0].set_data_from_numpy(np.random.default_rng(0).random((1, BIG), dtype=np.float32))
    return [("simple, 128 B answer", "simple_cached", small), ("identity, 602 KB answer", "identity_cached", big)]


def _measure(
    client: httpclient.InferenceServerClient, model: str, inputs: list[Any], requests: int
) -> dict[str, float]:
    for _ in range(50):
        client.infer(model, inputs)
    before = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    times = []
    for _ in range(requests):
        started = time.perf_counter_ns()
        client.infer(model, inputs)
        times.append((time.perf_counter_ns() - started) / 1000)
    after = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    times.sort()
    hits = after["cache_hit"]["count"] - before["cache_hit"]["count"]
    assert hits == requests, f"{requests - hits} of {requests} requests were not hits"
    return {
        "median": statistics.median(times), "p90": times[int(len(times) * 0.9)],
        "success": (after["success"]["ns"] - before["success"]["ns"]) / hits / 1000,
        "cache_hit": (after["cache_hit"]["ns"] - before["cache_hit"]["ns"]) / hits / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers-list", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000, help="hits per case (a quarter for the 602 KB one)")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers_list.split(",")]
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        models.simple(repo, "simple_cached", extra=CACHED)
        models.identity_fp32(repo, "identity_cached", CACHED)
        for round_ in range(args.rounds):
            for workers in counts[round_ % len(counts):] + counts[: round_ % len(counts)]:
                server_args = ["--workers", str(workers), "--cache-config", f"local,size={64 << 20}"]
                with geserve([repo], Path(tmp) / f"server-{workers}.log", server_args) as server:
                    time.sleep(1)
                    client = httpclient.InferenceServerClient(server.url)
                    try:
                        for label, model, inputs in _cases():
                            requests = args.requests if model == "simple_cached" else max(args.requests // 4, 1)
                            row = _measure(client, model, inputs, requests)
                            results.setdefault((workers, label), []).append(row)
                            print(f"round {round_ + 1} workers={workers} {label}: " + ", ".join(
                                f"{k} {v:.1f} us" for k, v in row.items()), flush=True)
                    finally:
                        client.close()
    print("\n| workers | case | client p50 (us) | client p90 (us) | server success (us) | server cache_hit (us) |")
    print("|---|---|---|---|---|---|")
    for (workers, label), rows in sorted(results.items()):
        medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {workers} | {label} | {medians['median']:.0f} | {medians['p90']:.0f} | {medians['success']:.1f} | "
              f"{medians['cache_hit']:.1f} |")


if __name__ == "__main__":
    main()
