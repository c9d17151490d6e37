"""What Ray Serve's proxy costs and what a second replica buys on this machine: one `geserve serve` process
against `geserve ray-serve` with 1 and with 2 replicas, MLP and ResNet-50 (examples/model_repository, dynamic
batching on), perf_analyzer over HTTP and gRPC at concurrency 1 and 16, alternating rounds.

A one-node Ray cluster (tests/support/ray_cluster.py, this machine's CPUs) runs the deployment; between the 1- and
2-replica configurations the application is redeployed (`geserve ray-serve --detach` again), so only one
configuration holds replicas at a time. The single geserve is one process (GESERVE_WORKERS=1) started once; it
sits idle while Ray is measured. Writes bench/results/ray.md and ray.json.
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
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

from tests.support import models  # noqa: E402
from tests.support.ray_cluster import ray_cluster, ray_env  # noqa: E402
from tests.support.reference import free_port, run_perf_analyzer  # noqa: E402
from tests.support.server import RunningServer, stop_geserve  # noqa: E402

MODELS = ("mlp", "resnet50")
PROTOCOLS = ("http", "grpc")
CONCURRENCIES = (1, 16)
WINDOW_SCALE = {"mlp": 1, "resnet50": 3}  # ResNet-50's requests take ~50x longer: a longer window, same stability


@dataclass
class System:
    name: str
    replicas: int  # 0: the single geserve
    http_port: int = 0
    grpc_port: int = 0
    samples: list[dict[str, float | None]] = field(default_factory=list)


def repository(dest: Path) -> Path:
    """The example models as configured plus `dynamic_batching {}` (how a replicated deployment would serve)."""
    for model in MODELS:
        models.example_onnx(model)  # builds it if it is not built yet
        target = dest / model
        target.mkdir(parents=True)
        for item in (harness.EXAMPLES / model).iterdir():
            if item.name not in ("config.pbtxt", ".stamp"):
                (target / item.name).symlink_to(item, target_is_directory=item.is_dir())
        config = harness.load_config(harness.EXAMPLES / model)
        config.dynamic_batching.SetInParent()
        (target / "config.pbtxt").write_text(text_format.MessageToString(config))
    return dest


def wait_ready(http_port: int, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready on :{http_port} after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def start_single(repo: Path, system: System, log: Path) -> RunningServer:
    system.http_port, system.grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(repo), "--http-address",
               "127.0.0.1", "--http-port", str(system.http_port), "--grpc-port", str(system.grpc_port),
               "--allow-metrics=false"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env={**os.environ, "GESERVE_WORKERS": "1"})
    server = RunningServer(process, system.http_port, log, system.grpc_port)
    wait_ready(system.http_port, 120, log)
    return server


def deploy(address: str, repo: Path, replicas: int, http_port: int, grpc_port: int, log: Path) -> None:
    """`geserve ray-serve --detach`: the first call starts Serve on the ports; later ones deploy the new count
    after removing the application (Serve keeps its proxies). The machine's cores are split between the replicas
    (`--num-cpus`), so each configuration has as many ONNX Runtime threads as the single geserve. Waits until
    every replica is up."""
    cpus = max(1, len(os.sched_getaffinity(0)) // replicas)
    # Removed first: a redeploy rolls replicas over (new ones up before old ones go), and the old replica holds
    # the CPUs the new ones need.
    remove = ("import contextlib, ray, sys; from ray import serve; ray.init(address=sys.argv[1])\n"
              "with contextlib.suppress(Exception): serve.delete('geserve')  # none yet: Serve not started")
    with log.open("ab") as out:
        subprocess.run([sys.executable, "-c", remove, address], stdout=out, stderr=subprocess.STDOUT, env=ray_env(),
                       check=True, timeout=300)
    command = [sys.executable, "-m", "geserve", "ray-serve", "--model-repository", str(repo), "--ray-address",
               address, "--num-replicas", str(replicas), "--num-cpus", str(cpus), "--http-port", str(http_port),
               "--grpc-port", str(grpc_port), "--allow-metrics=false", "--proxy-location", "HeadOnly", "--detach"]
    with log.open("ab") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=ray_env(), check=True,
                       timeout=300)
    wait_ready(http_port, 120, log)


def perf_analyzer(system: System, model: str, protocol: str, concurrency: int, mode: harness.Mode
                  ) -> harness.Point | None:
    """One perf_analyzer run (harness.py's settings); retried once at stability 100% and 3x the window."""
    port = system.http_port if protocol == "http" else system.grpc_port
    window_ms = mode.window_ms * WINDOW_SCALE[model]
    output = ""
    for stability, window in ((mode.stability, window_ms), (100, 3 * window_ms)):
        with tempfile.TemporaryDirectory(prefix="ray-pa-") as tmp:
            csv_path = Path(tmp) / "pa.csv"
            args = ["-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency-range", str(concurrency),
                    "--measurement-interval", str(window), "--stability-percentage", str(stability),
                    "--max-trials", str(mode.max_trials), "-f", str(csv_path)]
            result = run_perf_analyzer(args, timeout=120 + mode.max_trials * window / 1000 * 2)
            point = harness.read_csv_point(csv_path)
            output = result.stdout + result.stderr
        if point is not None:
            return point
    print(f"  {system.name} {model} {protocol} c={concurrency}: perf_analyzer gave no result: {output[-800:]}",
          file=sys.stderr)
    return None


def cells() -> list[tuple[str, str, int]]:
    return [(model, protocol, c) for model in MODELS for protocol in PROTOCOLS for c in CONCURRENCIES]


def key(model: str, protocol: str, concurrency: int, what: str) -> str:
    return f"{model} {protocol} c={concurrency} {what}"


def measure(system: System, mode: harness.Mode) -> dict[str, float | None]:
    values: dict[str, float | None] = {}
    for model, protocol, concurrency in cells():
        with harness.others_share() as others:
            point = perf_analyzer(system, model, protocol, concurrency, mode)
        values[key(model, protocol, concurrency, "infer/s")] = None if point is None else point.throughput
        values[key(model, protocol, concurrency, "p99")] = None if point is None else point.p99_us
        values[key(model, protocol, concurrency, "others")] = others[0]
        print(f"  {system.name:>22} {model:>8} {protocol:>4} c={concurrency:<2}: "
              + ("no result" if point is None else f"{point.throughput:8.1f} infer/s  p99 {point.p99_us:8.0f} µs"),
              file=sys.stderr)
    return values


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(systems: list[System], mode: harness.Mode, rounds: int, haproxy: bool = False) -> str:
    lines = [
        "# geserve on Ray Serve: the proxy's cost and a second replica (perf_analyzer)",
        "",
        f"{rounds} alternating round(s), median per cell; perf_analyzer window {mode.window_ms} ms (ResNet-50 "
        f"{mode.window_ms * WINDOW_SCALE['resnet50']} ms), stability {mode.stability}%, binary tensors. Models with "
        f"`dynamic_batching {{}}`. Date: {time.strftime('%Y-%m-%d')}. Machine: {harness.machine()}.",
        "",
        "Ray: a one-node cluster on this machine, one proxy (HTTP and gRPC), the cores split between the replicas "
        "(`num_cpus`: 2 for one replica, 1 each for two; a replica's ONNX Runtime threads follow it); the single "
        "geserve is one process (`--workers 1`) on the same machine. "
        + ("Ray's high-throughput mode: HAProxy on the proxy ports and the replicas' direct ingress "
           "(`RAY_SERVE_ENABLE_HA_PROXY=1`, `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`)." if haproxy
           else "Ray's default proxies (Python actors)."),
        "",
        "| model | protocol | c | " + " | ".join(f"{s.name} infer/s | p99 µs" for s in systems)
        + " | " + " | ".join(f"{s.name} / single" for s in systems[1:]) + " |",
        "|---|---|---:|" + "---:|---:|" * len(systems) + "---:|" * (len(systems) - 1),
    ]
    for model, protocol, concurrency in cells():
        row = [model, protocol, str(concurrency)]
        throughputs = []
        for system in systems:
            rate = median([s[key(model, protocol, concurrency, "infer/s")] for s in system.samples])
            p99 = median([s[key(model, protocol, concurrency, "p99")] for s in system.samples])
            throughputs.append(rate)
            row += ["n/a" if rate is None else f"{rate:.1f}", "n/a" if p99 is None else f"{p99:.0f}"]
        base = throughputs[0]
        row += ["n/a" if r is None or not base else f"{r / base:.2f}" for r in throughputs[1:]]
        lines.append("| " + " | ".join(row) + " |")
    busiest = max((s[k] or 0.0 for system in systems for s in system.samples for k in s if k.endswith("others")),
                  default=0.0)
    lines += [
        "",
        f"Other processes' share of the CPUs during the runs: at most {busiest:.0%} (above ~15% a cell is disturbed).",
        f"Rounds: {', '.join(f'{s.name}: ' + str(len(s.samples)) for s in systems)}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    global MODELS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 2; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="short perf_analyzer windows, one round")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of mlp and resnet50")
    parser.add_argument("--haproxy", action="store_true",
                        help="Ray's high-throughput mode (RAY_SERVE_ENABLE_HA_PROXY=1, "
                             "RAY_SERVE_THROUGHPUT_OPTIMIZED=1: HAProxy on the proxy ports, replicas' direct "
                             "ingress); writes ray_haproxy.md")
    args = parser.parse_args()
    MODELS = tuple(m for m in args.models.split(",") if m)
    if not set(MODELS) <= set(WINDOW_SCALE):
        parser.error(f"--models: choose among {', '.join(WINDOW_SCALE)}")
    mode = harness.QUICK if args.quick else harness.FULL
    rounds = args.rounds or (1 if args.quick else 2)
    if not harness.reference.perf_analyzer_path().is_file():
        print("perf_analyzer is missing: run scripts/install_reference.sh first", file=sys.stderr)
        return 1
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    if args.haproxy:  # read by the Ray nodes at start (tests/support/ray_cluster.py passes the environment on)
        os.environ.update({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"})
    name = "ray_haproxy" if args.haproxy else "ray"
    cpus = len(os.sched_getaffinity(0))
    single, ray1, ray2 = System("single geserve", 0), System("Ray, 1 replica", 1), System("Ray, 2 replicas", 2)
    ray1.http_port = ray2.http_port = free_port()
    ray1.grpc_port = ray2.grpc_port = free_port()
    with tempfile.TemporaryDirectory(prefix="geray-bench-", dir="/tmp") as tmp:
        repo = repository(Path(tmp) / "repo")
        server = start_single(repo, single, harness.RESULTS / "ray.single.log")
        try:
            with ray_cluster(Path(tmp) / "ray", cpus=(max(cpus, 2),)) as cluster:
                log = harness.RESULTS / "ray.deploy.log"
                log.write_bytes(b"")
                for index in range(rounds):
                    # single first on even rounds, Ray first on odd ones; Ray's two sizes alternate too
                    rays = [ray1, ray2] if index % 2 == 0 else [ray2, ray1]
                    order = [single, *rays] if index % 2 == 0 else [*rays, single]
                    for system in order:
                        print(f"round {index + 1}: {system.name}", file=sys.stderr)
                        if system.replicas:
                            deploy(cluster.address, repo, system.replicas, system.http_port, system.grpc_port, log)
                            time.sleep(3)  # let the replaced replicas' shutdown finish before measuring
                        harness.wait_for_quiet(10)
                        system.samples.append(measure(system, mode))
        finally:
            stop_geserve(server)
    systems = [single, ray1, ray2]
    text = report(systems, mode, rounds, args.haproxy)
    print(text)
    (harness.RESULTS / f"{name}.md").write_text(text)
    (harness.RESULTS / f"{name}.json").write_text(json.dumps({s.name: s.samples for s in systems}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
