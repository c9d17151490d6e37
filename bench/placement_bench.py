"""Where models live with `--workers N`: the two costs that decide it, measured.

1. Memory: the proportional set size (PSS, /proc/<pid>/smaps_rollup) of a single geserve process and of each
   worker of a two-worker server, both serving the example repository: what "models in every worker" costs.
2. The hop: a request handed to another process and answered (what "models once, in a model process" adds to every
   request), as CPU µs per round trip on both sides together, with geserve's own worker wire (pickled tensors over a
   Unix socket, ipc/peer.py) for an MLP request (256 float32 in, 10 out) and a ResNet-50 one (3x224x224 in,
   1000 out), next to the in-process compute of those models (MLP b=1 ~90 µs, ResNet-50 b=1 tens of ms here).

Writes bench/results/placement.md. Usage: .venv/bin/python bench/placement_bench.py [--models m1,m2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geserve.ipc.peer import Peer  # noqa: E402
from tests.support.server import geserve  # noqa: E402

REPOSITORY = ROOT / "examples" / "model_repository"
PAYLOADS = {"MLP": ((1, 256), (1, 10)), "ResNet-50": ((1, 3, 224, 224), (1, 1000))}


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def memory(models: list[str], tmp: Path) -> list[str]:
    args = ["--model-control-mode", "explicit", *[a for m in models for a in ("--load-model", m)]]
    rows = []
    with geserve([REPOSITORY], tmp / "one.log", [*args, "--workers", "1"]) as one:
        time.sleep(2)
        single = pss_kib(one.process.pid)
    with geserve([REPOSITORY], tmp / "two.log", [*args, "--workers", "2"]) as two:
        time.sleep(8)  # both workers up (live answers as soon as the first one is)
        supervisor = pss_kib(two.process.pid)
        workers = [pss_kib(pid) for pid in children(two.process.pid)]
    rows.append(f"| 1 process | {single / 1024:.0f} | — | {single / 1024:.0f} |")
    rows.append(f"| 2 workers | {sum(workers) / len(workers) / 1024:.0f} each | {supervisor / 1024:.0f} | "
                f"{(sum(workers) + supervisor) / 1024:.0f} |")
    return rows


def _echo_server(path: str, output_shape: tuple[int, ...]) -> None:
    answer = np.zeros(output_shape, dtype=np.float32)

    async def main() -> None:
        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async def handle(method: str, args: tuple[Any, ...]) -> Any:
                return answer

            peer = Peer(reader, writer, handle)
            peer.start()
            await peer.closed.wait()

        server = await asyncio.start_unix_server(connected, path=path)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def hop(name: str, calls: int) -> str:
    input_shape, output_shape = PAYLOADS[name]
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "hop.sock")
        child = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(path, output_shape))
        child.start()
        while not Path(path).exists():
            time.sleep(0.01)
        tensor = np.random.default_rng(0).standard_normal(input_shape, dtype=np.float32)

        async def client() -> tuple[float, float]:
            reader, writer = await asyncio.open_unix_connection(path)

            async def refuse(method: str, args: tuple[Any, ...]) -> Any:
                raise RuntimeError(method)

            peer = Peer(reader, writer, refuse)
            peer.start()
            for _ in range(50):
                await peer.call("run", tensor)
            child_before = _cpu(child.pid)
            start_cpu, start = time.process_time(), time.perf_counter()
            for _ in range(calls):
                await peer.call("run", tensor)
            wall = time.perf_counter() - start
            cpu = time.process_time() - start_cpu + _cpu(child.pid) - child_before
            await peer.close()
            return wall / calls * 1e6, cpu / calls * 1e6

        wall_us, cpu_us = asyncio.run(client())
        child.terminate()
        child.join()
    return f"| {name} | {np.prod(input_shape) * 4 / 1024:.1f} KiB | {wall_us:.0f} | {cpu_us:.0f} |"


def _cpu(pid: int | None) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet50,efficientnet_lite0,minilm,digits")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        memory_rows = memory(args.models.split(","), Path(tmp))
    lines = [
        "# Where models live with --workers", "",
        f"Models loaded: {args.models}. PSS in MiB (shared pages split between the processes that map them).", "",
        "| server | per worker (MiB) | supervisor (MiB) | total (MiB) |", "|---|---:|---:|---:|", *memory_rows, "",
        "A request handed to another process and answered over geserve's worker wire (pickled tensors, Unix socket):",
        "", "| request | input | round trip (µs) | CPU, both sides (µs) |", "|---|---:|---:|---:|",
        *(hop(name, args.calls if name == "MLP" else max(50, args.calls // 20)) for name in PAYLOADS),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "bench" / "results" / "placement.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
