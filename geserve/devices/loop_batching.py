"""The event loop's CPU scheduling: normally a short time slice, so that an arrival preempts a running execution at
once (devices/thread_scheduling.py); under overload, while admission control refuses arrivals, SCHED_BATCH at the
kernel's default slice, so that an arrival no longer preempts the model's compute thread the moment it lands.

Why: at four times a model's capacity most arrivals are refused, each in a few µs of Python, but each also woke the
loop on its own: two context switches on the model's core and a loop iteration for one request. Batch-scheduled, a
woken loop waits for the scheduler's next tick while a compute thread runs (not at all on an idle core) and then
reads every arrival of that tick at once; the compute threads' lower nice value (compute_priority.py) still gives it
the core at that tick. Measured (bench/overload_bench.py, 2-vCPU VM, three alternating pairs of runs): the loop took
15-16% of the model's core at 4x, 11-13% batch-scheduled; goodput at 4x 472-482/s, 473-503/s batch-scheduled; at 2x
483-493/s, 498-502/s.

The price is that wait, at most one tick plus a slice: a request may sit that long in its socket before the loop
reads it, and the server's clock starts its deadline that late. `read_delay_s` is that bound while it can apply,
and the caller's deadline is kept that much earlier (service/deadlines.py), so no success reaches its caller late.
The loop goes back to normal scheduling once nothing was refused for a while: without overload it keeps its
immediate wake-ups. It switches only once refusals come fast (20 within 100 ms): a few refusals save a few wake-ups,
while the read delay taken off every deadline for a second made the deadline budget refuse more (at half the
capacity one refusal in a Poisson burst was followed by 30-80 more within the benchmark's 30 s, against none
otherwise). Linux only; elsewhere nothing changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import platform
import sys
import threading
import time
from pathlib import Path

from geserve.devices import thread_scheduling

IDLE_WINDOW_S = 1.0  # the loop is scheduled normally again once nothing was refused for this long
ENGAGE_REFUSALS, ENGAGE_WINDOW_S = 20, 0.1  # it is batch-scheduled once this many refusals come within this window
_DEFAULT_HZ = 250  # the common distribution kernels' tick when the kernel's configuration cannot be read
_SLICE_S = 0.001  # what a running thread may keep of its slice past the tick (EEVDF's run-to-parity)
_SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "SCHED_BATCH")


def kernel_tick_s() -> float:
    """The kernel's timer tick (1 / CONFIG_HZ), from its configuration where readable, else 1/250 s."""
    sources = (Path("/proc/config.gz"), Path(f"/boot/config-{platform.release()}"))
    for source in sources:
        with contextlib.suppress(OSError, EOFError):
            text = gzip.decompress(source.read_bytes()) if source.suffix == ".gz" else source.read_bytes()
            for line in text.splitlines():
                if line.startswith(b"CONFIG_HZ="):
                    return 1.0 / int(line.split(b"=", 1)[1])
    return 1.0 / _DEFAULT_HZ


class LoopBatching:
    """One process's switch (`LOOP_BATCHING`): `refused()` on each admission refusal, `read_delay_s` for deadlines."""

    __slots__ = ("_enabled", "_engage_after", "_idle_window_s", "_last_refusal", "_run", "_run_start", "_settled_at",
                 "_slice_s", "_thread", "bound_s")

    def __init__(self, idle_window_s: float = IDLE_WINDOW_S, engage_after: int = ENGAGE_REFUSALS) -> None:
        self._enabled = _SUPPORTED
        self._idle_window_s = idle_window_s
        self._engage_after = engage_after
        self._run = 0  # refusals since `_run_start`, the first of the latest ENGAGE_WINDOW_S
        self._run_start = 0.0
        self._thread = 0  # the batch-scheduled loop thread's native id; 0 while it runs normally
        self._last_refusal = 0.0
        self._settled_at = 0.0  # until then a request read may still have waited for a tick (after going back)
        self._slice_s = 0.0  # the loop's time slice while scheduled normally (0: the kernel's default)
        self.bound_s = kernel_tick_s() + _SLICE_S

    def configure(self, enabled: bool, short_slice: bool) -> None:
        """`--loop-batching`: whether refusals may batch-schedule the loop (off: it always wakes at once);
        `short_slice`: whether the loop, scheduled normally, preempts a running execution at once."""
        self._enabled = enabled and _SUPPORTED
        self._slice_s = thread_scheduling.SHORTEST_SLICE_S if short_slice else 0.0

    def claim(self) -> None:
        """Called on the event loop's thread as the server starts: its normal scheduling, with the short slice."""
        if _SUPPORTED and self._slice_s:
            thread_scheduling.set_policy(threading.get_native_id(), os.SCHED_OTHER, self._slice_s)

    @property
    def batched(self) -> bool:
        return bool(self._thread)

    def read_delay_s(self, now: float) -> float:
        """How long a request read at `now` may have waited in its socket for the loop: the bound while the loop is
        batch-scheduled (and one bound after), else 0."""
        return self.bound_s if self._thread or now < self._settled_at else 0.0

    def refused(self, now: float) -> None:
        """An arrival was refused at `now`, on the loop's thread: once refusals come fast, the loop is batch-scheduled
        from now on, until a refusal-free window passes."""
        self._last_refusal = now
        if self._thread or not self._enabled or not self._fast(now):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # refused off any loop (a test of admission alone): there is no loop to schedule
            return
        thread = threading.get_native_id()
        # The kernel's default slice meanwhile: a turn reading a tick's arrivals runs whole, not cut at the next tick.
        if thread_scheduling.set_policy(thread, os.SCHED_BATCH):
            self._thread = thread
            loop.call_later(self._idle_window_s, self._check)

    def _fast(self, now: float) -> bool:
        """Whether the refusal at `now` makes `_engage_after` within ENGAGE_WINDOW_S of the run's first."""
        if now - self._run_start > ENGAGE_WINDOW_S:
            self._run_start, self._run = now, 0
        self._run += 1
        return self._run >= self._engage_after

    def _check(self) -> None:
        now = time.monotonic()
        quiet_for = now - self._last_refusal
        if quiet_for < self._idle_window_s:
            asyncio.get_running_loop().call_later(self._idle_window_s - quiet_for, self._check)
            return
        thread_scheduling.set_policy(self._thread, os.SCHED_OTHER, self._slice_s)
        self._thread = 0
        self._settled_at = now + self.bound_s


LOOP_BATCHING = LoopBatching()
