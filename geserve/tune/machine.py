"""How much of the machine's CPU other processes used while we measured, from /proc (Linux; elsewhere: unknown)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")


def machine_ticks() -> list[int]:
    """The whole machine's CPU clock ticks since boot by state (/proc/stat's `cpu` line: user, nice, system, idle,
    iowait, irq, softirq, steal, then guest time, already inside user)."""
    return [int(v) for v in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = machine_ticks()
    total = sum(values[:8])  # guest time is already inside user
    return (total - values[3] - values[4]) / CLOCK_TICKS, total / CLOCK_TICKS  # minus idle and iowait


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of the process and its reaped children), of every process alive now."""
    table: dict[int, tuple[int, float]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        table[int(stat.parent.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / CLOCK_TICKS)
    return table


def _tree(root: int, table: dict[int, tuple[int, float]]) -> set[int]:
    tree, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier} - tree
        tree |= frontier
    return tree


def tree_cpu_s(root: int) -> float:
    """CPU seconds used by `root` and every descendant alive now (with their reaped children's)."""
    table = _processes()
    return sum(table[pid][1] for pid in _tree(root, table) if pid in table)


def tree_size(root: int) -> int:
    """Processes in `root`'s tree now (a server's supervisor and workers, tritonserver and its stubs)."""
    return len(_tree(root, _processes()))


def own_cpu_s() -> float:
    """CPU seconds used by this process and all its descendants (the server, perf_analyzer)."""
    return tree_cpu_s(os.getpid())


def can_measure() -> bool:
    return (PROC / "stat").is_file()


@contextmanager
def others_share() -> Iterator[list[float]]:
    """Yields a list that receives, on exit, the share of the machine's CPUs that processes not ours used
    meanwhile (nothing where /proc does not exist)."""
    result: list[float] = []
    if not can_measure():
        yield result
        return
    (busy0, total0), own0 = machine_busy_s(), own_cpu_s()
    yield result
    (busy1, total1), own1 = machine_busy_s(), own_cpu_s()
    share = ((busy1 - busy0) - (own1 - own0)) / max(1e-9, total1 - total0)
    result.append(min(1.0, max(0.0, share)))  # clamped: /proc snapshots of exiting processes can race


def wait_for_quiet(busy_limit: float, max_wait_s: float) -> bool:
    """Wait (up to `max_wait_s`) until others use at most `busy_limit` of the CPUs over half a second."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        with others_share() as share:
            time.sleep(0.5)
        if not share or share[0] <= busy_limit:
            return True
    return False
