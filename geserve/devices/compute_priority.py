"""The compute threads' CPU priority (--compute-nice): model executions run below the event loop, so that the front
door (arrivals, refusals, answers, health probes) preempts them on a core they share.

Why: on a busy core the kernel lets a running compute thread finish its time slice (3-4 ms) before the woken event
loop runs; every arrival then waits that long before the server sees it, answers leave that late, and a deadline the
server keeps from its own clock ends later at the client than it did at the server (bench/overload_bench.py counted
late successes from it, and health probes waited up to 27 ms at 4x overload). With the compute threads a few nice
levels down (and, on kernels since 6.6, the loop's own short slice: thread_scheduling.py) the loop preempts them at
once, and still cannot starve them: the kernel's weights keep them a share (nice 5: about a quarter of a core the
loop saturates). Linux only (a thread's nice value is its own there).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

DEFAULT_COMPUTE_NICE = 5
_T = TypeVar("_T")
_compute_nice = DEFAULT_COMPUTE_NICE


def configure(nice: int) -> None:
    """This process's compute threads run `nice` levels below the thread that starts them (0: at the same level)."""
    global _compute_nice
    _compute_nice = max(0, nice)


def lower_this_thread() -> None:
    """Lower the calling thread, as a compute thread (an instance's worker, at its start). Never raises: a platform
    without per-thread nice values keeps its priority."""
    _lower(threading.get_native_id())


def lower_process(pid: int) -> None:
    """Lower a child process just started (an isolated Python model's, all of it compute): its main thread, whose
    nice value the threads it starts inherit. Never raises (a child already gone keeps nothing to lower)."""
    _lower(pid)


def _lowers() -> bool:
    """Whether compute threads run lowered here: a nice offset is set, and the platform keeps one per thread."""
    return _compute_nice > 0 and sys.platform.startswith("linux")


def _lower(task: int) -> None:
    """`task` (a thread's native id, or a process's main thread: Linux keeps a nice value per thread) lowered."""
    if not _lowers():
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, task, os.getpriority(os.PRIO_PROCESS, task) + _compute_nice)


def started_lowered(create: Callable[[], _T]) -> _T:
    """`create()` run on a short-lived lowered thread, so that the threads it starts (an ONNX Runtime session's
    intra-op pool) inherit the lowered priority; its result or its exception, as if called here."""
    if not _lowers():
        return create()
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        lower_this_thread()
        try:
            outcome.append(create())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="ge-session-start", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
