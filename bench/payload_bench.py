"""Large tensors over gRPC and HTTP: the time of one inference on an identity model (FP16) by payload size.

The time should grow with the bytes, not faster: a 32 MiB gRPC request once took 17 s (each HTTP/2 frame's bytes were
joined to all those held before it). Starts geserve on a fresh repository, sends 2-128 MiB each way with the real
tritonclient (gRPC with its size limits raised; HTTP with binary tensors, the server's input limit raised past
Triton's 64 MiB default), median of `--rounds`, and writes
bench/results/payload.md. Usage: .venv/bin/python bench/payload_bench.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import models  # noqa: E402
from tests.support.server import RunningServer, geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "payload.md"
SIZES_MIB = (2, 8, 32, 128)
MODEL = "identity_fp16"
GRPC_LIMIT = 2**31 - 1


def _grpc(server: RunningServer) -> Callable[[np.ndarray], float]:
    client = grpcclient.InferenceServerClient(server.grpc_url, channel_args=[
        ("grpc.max_send_message_length", GRPC_LIMIT), ("grpc.max_receive_message_length", GRPC_LIMIT)])

    def infer(value: np.ndarray) -> float:
        tensor = grpcclient.InferInput("INPUT0", list(value.shape), "FP16")
        tensor.set_data_from_numpy(value)
        started = time.perf_counter()
        answer = client.infer(MODEL, [tensor]).as_numpy("OUTPUT0")
        elapsed = time.perf_counter() - started
        assert answer is not None and answer.shape == value.shape
        return elapsed

    return infer


def _http(server: RunningServer) -> Callable[[np.ndarray], float]:
    client = httpclient.InferenceServerClient(server.url, network_timeout=600, connection_timeout=600)

    def infer(value: np.ndarray) -> float:
        tensor = httpclient.InferInput("INPUT0", list(value.shape), "FP16")
        tensor.set_data_from_numpy(value, binary_data=True)
        wanted = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        started = time.perf_counter()
        answer = client.infer(MODEL, [tensor], outputs=[wanted]).as_numpy("OUTPUT0")
        elapsed = time.perf_counter() - started
        assert answer is not None and answer.shape == value.shape
        return elapsed

    return infer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        models.identity(repo, "fp16")
        with geserve([repo], Path(tmp) / "geserve.log", [f"--http-max-input-size={1 << 30}"]) as server:
            protocols = {"gRPC": _grpc(server), "HTTP": _http(server)}
            seconds: dict[tuple[str, int], list[float]] = {}
            for _ in range(args.rounds):
                for size in SIZES_MIB:
                    value = np.arange(size * 512 * 1024, dtype=np.float16)[None]  # size MiB
                    for name, infer in protocols.items():
                        seconds.setdefault((name, size), []).append(infer(value))
    lines = ["| MiB each way | " + " | ".join(f"{name} s | {name} MiB/s" for name in protocols) + " |",
             "|---:|" + "---:|---:|" * len(protocols)]
    for size in SIZES_MIB:
        cells = []
        for name in protocols:
            median = statistics.median(seconds[(name, size)])
            cells += [f"{median:.3f}", f"{2 * size / median:.0f}"]
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    report = "\n".join(["# Large tensors: one inference's time by payload size", "",
                        f"geserve, identity FP16 model, real tritonclient, median of {args.rounds}; MiB/s counts "
                        "both ways.", "", *lines, ""])
    print(report)
    RESULTS.write_text(report)
    print(f"written to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
