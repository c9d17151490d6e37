"""How late an event loop reads an arrival on a core where a lowered compute thread runs: the kernel's default time
slice for the loop against the shortest (devices/thread_scheduling.py), alternating rounds.

Usage: .venv/bin/python bench/loop_wakeup_bench.py [--rounds 3] [--seconds 10] [--rate 500]

Each round forks a client pinned to core 1 that sends its monotonic clock (8 bytes) on one TCP connection at Poisson
arrivals; the loop (uvloop, pinned to core 0) notes for each read how long after the send it came, while a thread
lowered as geserve lowers compute threads (devices/compute_priority.py, nice +5) multiplies matrices on the same core
without pause. Linux only. Prints a table and writes bench/results/loop_wakeup.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import struct
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one compute thread: numpy's BLAS must not start its own

import numpy as np
import uvloop

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from geserve.devices import compute_priority, thread_scheduling  # noqa: E402

STAMP = struct.Struct("q")
SLICES = {"kernel default": 0.0, "shortest (geserve)": thread_scheduling.SHORTEST_SLICE_S}


class Reads(asyncio.Protocol):
    def __init__(self, delays: list[int]) -> None:
        self.delays = delays
        self.pending = b""

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        data = self.pending + data
        whole = len(data) - len(data) % STAMP.size
        self.delays.extend(now - sent for (sent,) in STAMP.iter_unpack(data[:whole]))
        self.pending = data[whole:]


def compute(stop: threading.Event) -> None:
    compute_priority.lower_this_thread()
    matrix = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
    while not stop.is_set():
        matrix @ matrix


def client(port: int, seconds: float, rate: float) -> None:
    os.sched_setaffinity(0, {1})
    connection = socket.create_connection(("127.0.0.1", port))
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        connection.send(STAMP.pack(time.monotonic_ns()))
        time.sleep(random.expovariate(rate))
    connection.close()


async def round_of(slice_s: float, seconds: float, rate: float) -> np.ndarray:
    thread_scheduling.set_policy(threading.get_native_id(), os.SCHED_OTHER, slice_s)
    delays: list[int] = []
    server = await asyncio.get_running_loop().create_server(lambda: Reads(delays), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    child = os.fork()
    if child == 0:
        client(port, seconds, rate)
        os._exit(0)
    await asyncio.get_running_loop().run_in_executor(None, os.waitpid, child, 0)
    server.close()
    return np.array(delays[len(delays) // 20:]) / 1e6  # ms; the first twentieth is the warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=500.0)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    stop = threading.Event()
    worker = threading.Thread(target=compute, args=(stop,))
    worker.start()
    rows = []
    for index in range(args.rounds):
        for name, slice_s in SLICES.items():
            d = uvloop.run(round_of(slice_s, args.seconds, args.rate))
            rows.append(f"| {index + 1} | {name} | {len(d)} | {np.percentile(d, 50):.3f} | {np.percentile(d, 99):.3f} "
                        f"| {np.percentile(d, 99.9):.3f} | {d.max():.3f} | {(d > 1).sum()} |")
            print(rows[-1], flush=True)
    stop.set()
    worker.join()
    lines = ["# The event loop's read delay beside a running compute thread", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}; `.venv/bin/python bench/loop_wakeup_bench.py "
             f"{' '.join(sys.argv[1:])}`; Linux {os.uname().release}, {os.cpu_count()} CPUs; {args.rate:g} arrivals/s "
             f"for {args.seconds:g} s a round; the loop and a nice +5 compute thread on core 0, the client on core 1.",
             "", "| round | loop's slice | reads | p50 ms | p99 ms | p99.9 ms | max ms | over 1 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|", *rows]
    out = REPO_ROOT / "bench" / "results" / "loop_wakeup.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"written to {out.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
