"""The floor of one request's hop to another process and back, in Python: a 1 KB message through shared memory with
a one-byte pipe write as the wake-up each way, no pickling, no event loop. It bounds what a model process (one
batcher for every worker, issue 15's batched cell) could cost per hop; our worker wire costs 135 µs per message
(bench/placement_bench.py). Reports each side's CPU and the wall time per round trip, medians over the rounds.
Writes bench/results/ipc_hop.md.

Usage: .venv/bin/python bench/ipc_hop_bench.py [--rounds N] [--trips N]
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
import time
from pathlib import Path

from report_table import median_rows

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
PAYLOAD = b"x" * 1024


def one_round(trips: int) -> tuple[float, float, float]:
    """(client CPU µs, server CPU µs, wall µs) per round trip."""
    shared = mmap.mmap(-1, 1 << 16)
    to_server_r, to_server_w = os.pipe()
    to_client_r, to_client_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        started = time.process_time()
        for _ in range(trips):
            os.read(to_server_r, 1)
            size = struct.unpack_from("I", shared, 0)[0]
            shared[4:4 + size] = shared[4:4 + size]  # read the request, write the answer in its place
            os.write(to_client_w, b"!")
        os.write(report_w, struct.pack("d", (time.process_time() - started) / trips * 1e6))
        os._exit(0)
    started, wall = time.process_time(), time.perf_counter()
    for _ in range(trips):
        struct.pack_into("I", shared, 0, len(PAYLOAD))
        shared[4:4 + len(PAYLOAD)] = PAYLOAD
        os.write(to_server_w, b"!")
        os.read(to_client_r, 1)
        _ = shared[4:4 + len(PAYLOAD)]
    client = (time.process_time() - started) / trips * 1e6
    elapsed = (time.perf_counter() - wall) / trips * 1e6
    server = struct.unpack("d", os.read(report_r, 8))[0]
    os.waitpid(pid, 0)
    for descriptor in (to_server_r, to_server_w, to_client_r, to_client_w, report_r, report_w):
        os.close(descriptor)
    return client, server, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trips", type=int, default=20000)
    args = parser.parse_args()
    rounds = [one_round(args.trips) for _ in range(args.rounds)]
    labels = ("caller's CPU", "other process's CPU", "wall time")
    cells = dict(zip(labels, zip(*rounds, strict=True), strict=True))
    lines = [
        "# One hop to another process and back: the floor in Python",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {args.rounds} rounds of {args.trips} round trips, medians; 1 KB "
        "through shared memory, a pipe byte as the wake-up each way; `.venv/bin/python bench/ipc_hop_bench.py`",
        "",
        *median_rows("per round trip", "µs", cells, 1),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ipc_hop.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
