"""A thread's scheduling policy with its EEVDF time slice, through Linux's `sched_setattr` (Python's os module wraps
only `sched_setscheduler`, which cannot ask for a slice).

Why the slice: since Linux 6.6 the fair scheduler (EEVDF) lets a running thread keep the core until its slice ends
(0.7 ms x (1 + log2 CPUs): 1.4 ms on two) before a woken thread of a lower nice value runs; only a woken thread
with a shorter slice than the running one's preempts it at once (6.12's PREEMPT_SHORT). Measured on a 2-vCPU VM
(6.18), a loop reading 500 arrivals a second on a core with a nice-5 compute thread (bench/loop_wakeup_bench.py,
eight rounds): 41 of 35,000 reads came more than 1 ms after the send (up to 3.6 ms) at the default slice, 8 with a
0.1 ms one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
import sys

SHORTEST_SLICE_S = 0.0001  # the kernel clamps a requested slice to 0.1-100 ms
_LINUX = sys.platform.startswith("linux")
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}.get(platform.machine()) if _LINUX else None
_SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}.get(platform.machine()) if _LINUX else None
_RESET_ON_FORK = 0x01  # the threads it starts take the default policy's slice, not this one's
_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr, its first version (56 bytes)
_LIBC = ctypes.CDLL(None, use_errno=True) if _LINUX else None


def set_policy(thread: int, policy: int, slice_s: float = 0.0) -> bool:
    """`thread` (a native thread id) to run under `policy` (SCHED_OTHER or SCHED_BATCH) at its nice value, with a
    time slice of `slice_s` (0: the kernel's default; kernels before 6.12 ignore it); the threads it starts later
    keep the default slice. Whether the policy took; never raises."""
    if _SCHED_SETATTR is not None:
        with contextlib.suppress(OSError):
            nice = os.getpriority(os.PRIO_PROCESS, thread)
            attr = _ATTR.pack(_ATTR.size, policy, _RESET_ON_FORK, nice, 0, round(slice_s * 1e9), 0, 0, 0, 0)
            if _syscall(_SCHED_SETATTR, thread, ctypes.create_string_buffer(attr), 0) == 0:
                return True
    try:  # another architecture, or a kernel without sched_setattr (before 3.14): the policy alone
        os.sched_setscheduler(thread, policy, os.sched_param(0))
    except (OSError, AttributeError):  # AttributeError: not Linux
        return False
    return True


def slice_s(thread: int) -> float:
    """The time slice `thread` runs with, as Linux 6.12 and later report it (0: not reported here)."""
    if _SCHED_GETATTR is None:
        return 0.0
    buffer = ctypes.create_string_buffer(_ATTR.size)
    if _syscall(_SCHED_GETATTR, thread, buffer, _ATTR.size, 0) != 0:
        return 0.0
    return _ATTR.unpack(buffer.raw)[5] / 1e9


def policy(thread: int) -> int:
    """The policy `thread` runs under (os.SCHED_*), less the reset-on-fork flag `set_policy` adds to it."""
    return os.sched_getscheduler(thread) & ~os.SCHED_RESET_ON_FORK


def _syscall(number: int, *args: object) -> int:
    assert _LIBC is not None  # the syscall numbers are known on Linux only
    return int(_LIBC.syscall(number, *args))
