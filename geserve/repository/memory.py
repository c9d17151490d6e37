"""What a model costs in memory, measured, and giving memory back once a model is unloaded.

A load's cost is what it added to the proportional set size (PSS, /proc/<pid>/smaps_rollup) of the processes that
hold the model: a page k processes map counts 1/k in each, so the sum over the processes is what the machine pays,
weights mapped by every worker counted once. Measured after a trim, so the heap ONNX Runtime used while it built the
session and freed again is not counted.

Unloading gives the memory back only if something returns it to the system: dropping the last reference to a
session frees its arena and weights inside the C heap, a collection frees what reference cycles held (a Python
model's objects), and glibc's `malloc_trim` hands the free pages of every heap arena back. Measured: a MiniLM
session's 100 MiB stayed resident after `del` until trimmed, and geserve's own cycles held it until collected.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os
import re
import sys
from collections.abc import Iterable
from functools import cache

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENA_VARIABLE = "MALLOC_ARENA_MAX"  # glibc reads it once, as a process starts
_MAPPING = re.compile(rb"^[0-9a-f]+-[0-9a-f]+ ")  # the first line of a mapping in /proc/<pid>/smaps


def pss(pid: int = 0) -> int:
    """Bytes of PSS of process `pid` (this one for 0); its resident size where the kernel has no smaps_rollup (before
    Linux 4.14); 0 for a process that is gone or not on Linux."""
    proc = f"/proc/{pid or 'self'}"
    try:
        with open(f"{proc}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    try:
        with open(f"{proc}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def mapped_files() -> dict[str, tuple[int, int]]:
    """This process's file mappings other than shared libraries (weights ONNX Runtime maps: the prepacked weights of
    backends/ge/shared_weights.py), by path: (bytes mapped, bytes resident now). Linux only; empty elsewhere."""
    found: dict[str, tuple[int, int]] = {}
    path = ""
    try:
        with open("/proc/self/smaps", "rb") as smaps:
            for line in smaps:
                if _MAPPING.match(line):
                    parts = line.split(maxsplit=5)
                    name = parts[5].strip().decode(errors="replace") if len(parts) > 5 else ""
                    path = name if name.startswith("/") and ".so" not in name else ""
                elif path and line.startswith((b"Size:", b"Rss:")):
                    size, rss = found.get(path, (0, 0))
                    kib = int(line.split()[1]) * 1024
                    found[path] = (size + kib, rss) if line.startswith(b"Size:") else (size, rss + kib)
    except OSError:
        return {}
    return found


def not_yet_resident(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> int:
    """What the files mapped between `before` and `after` will add once their pages are read: mapped weights become
    resident page by page as the model runs (an embedding table only as its rows are looked up), so a load is
    charged their whole size, not only what it touched."""
    return sum(size - rss for path, (size, rss) in after.items() if path not in before)


def total_pss(pids: Iterable[int]) -> int:
    """PSS of several processes together: what they cost the machine, pages they share counted once."""
    return sum(pss(pid) for pid in pids)


@cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where its malloc_trim and mallopt are missing (musl, macOS: their allocators return memory on
    their own terms)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - both or neither
    except (OSError, AttributeError):
        return None
    return libc


def exec_with_one_heap() -> None:
    """Run this command again with MALLOC_ARENA_MAX=1 in its environment (the same process: exec), unless it has it:
    `one_heap` for the whole process, threads started on import included (numpy's and ONNX Runtime's start before
    any of geserve's code runs), and for the workers it starts, which inherit the variable."""
    if os.environ.get(ARENA_VARIABLE) == "1" or _libc() is None:
        return
    os.environ[ARENA_VARIABLE] = "1"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def one_heap() -> None:
    """Make glibc's malloc keep one arena for every thread (M_ARENA_MAX = 1), for a server with a memory budget:
    `malloc_trim` cannot shrink the top of a thread's arena, which then shrank on its own during later loads and
    made their measurements miss megabytes (a 4.5 MiB model measured from 0.4 to 8.6 MiB with an arena per thread,
    4.52 to 4.56 with one). Only threads that have no arena yet follow it: `exec_with_one_heap` covers those that
    started before geserve's code ran."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_ARENA_MAX, 1)


def trim_heap() -> None:
    """Return the C heap's free pages to the system (blocking, GIL released: run it on a thread)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


async def give_back() -> None:
    """After an unload: collect what reference cycles held, then trim the heap on a thread."""
    gc.collect()
    await asyncio.to_thread(trim_heap)


async def settled_pss() -> int:
    """This process's PSS once garbage is collected and the heap trimmed: a measurement free of memory freed but not
    yet returned, and of garbage a collection would free in the middle of the next measurement."""
    gc.collect()
    await asyncio.to_thread(trim_heap)
    return pss()
