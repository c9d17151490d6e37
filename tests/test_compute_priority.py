"""The compute threads' priority (--compute-nice, devices/compute_priority.py): model executions run below the event
loop, and so do the intra-op threads ONNX Runtime starts for a session, and the loop takes the shortest time slice
(devices/thread_scheduling.py); checked on real threads and on a real server process with a real ONNX Runtime
session (Linux: /proc shows each thread's nice value, sched_getattr its slice)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from geserve.devices import compute_priority
from geserve.devices.thread_scheduling import SHORTEST_SLICE_S, slice_s
from tests.support import models
from tests.support.server import geserve

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def nice_of(thread_id: int, pid: int | None = None) -> int:
    """A thread's nice value, from /proc (os.getpriority reads the same, but only for this process's threads)."""
    stat = Path(f"/proc/{pid or os.getpid()}/task/{thread_id}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


@pytest.fixture
def nice_offset() -> Iterator[int]:
    compute_priority.configure(3)
    yield 3
    compute_priority.configure(compute_priority.DEFAULT_COMPUTE_NICE)


def on_new_thread(work: object) -> None:
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def test_a_compute_thread_runs_below_its_starter(nice_offset: int) -> None:
    base = nice_of(threading.get_native_id())
    seen: list[int] = []

    def work() -> None:
        compute_priority.lower_this_thread()
        seen.append(nice_of(threading.get_native_id()))

    on_new_thread(work)
    assert seen == [base + nice_offset]
    assert nice_of(threading.get_native_id()) == base  # the caller's own priority is untouched


def test_threads_a_lowered_start_starts_inherit_the_lower_priority(nice_offset: int) -> None:
    base = nice_of(threading.get_native_id())
    seen: list[int] = []

    def start_pool() -> str:
        on_new_thread(lambda: seen.append(nice_of(threading.get_native_id())))
        return "session"

    assert compute_priority.started_lowered(start_pool) == "session"
    assert seen == [base + nice_offset]
    assert nice_of(threading.get_native_id()) == base


def test_a_lowered_start_raises_what_it_raised(nice_offset: int) -> None:
    def fail() -> None:
        raise ValueError("no graph")

    with pytest.raises(ValueError, match="no graph"):
        compute_priority.started_lowered(fail)


def test_zero_leaves_every_thread_where_it_was() -> None:
    compute_priority.configure(0)
    try:
        base = nice_of(threading.get_native_id())
        seen: list[int] = []
        on_new_thread(lambda: (compute_priority.lower_this_thread(), seen.append(nice_of(threading.get_native_id()))))
        assert seen == [base]
    finally:
        compute_priority.configure(compute_priority.DEFAULT_COMPUTE_NICE)


def server_nice_values(pid: int) -> dict[int, int]:
    return {int(task.name): nice_of(int(task.name), pid) for task in Path(f"/proc/{pid}/task").iterdir()}


def infer(url: str) -> None:
    client = httpclient.InferenceServerClient(url)
    inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
    assert client.infer("simple", inputs).as_numpy("OUTPUT0").tolist() == [[2] * 16]


ISOLATED = ('backend: "python"\nmax_batch_size: 0\n'
            'input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]\n'
            'output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]\n'
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n'
            'parameters { key: "isolation" value: { string_value: "process" } }\n')


@pytest.mark.parametrize("offset", [5, 0])
def test_a_server_runs_its_model_threads_below_its_event_loop(tmp_path: Path, offset: int) -> None:
    """An ONNX model with two intra-op threads (the instance's worker computes, with one pool thread ONNX Runtime
    starts) and a Python model in a process of its own (all of it compute)."""
    repo = tmp_path / "repo"
    models.simple(repo, extra='parameters { key: "intra_op_thread_count" value: { string_value: "2" } }')
    models.slow_python(repo, "isolated", ISOLATED)
    with geserve([repo], tmp_path / "server.log", ["--compute-nice", str(offset)]) as server:
        infer(server.url)
        pid = server.process.pid
        values = server_nice_values(pid)
        slices = {thread: slice_s(thread) for thread in values}
        model_processes = [server_nice_values(child) for child in server.children()]
    base = values[pid]  # the main thread runs the event loop
    lowered = [thread for thread, value in values.items() if value == base + offset and thread != pid]
    assert model_processes, "the isolated Python model's process"
    assert all(set(threads.values()) == {base + offset} for threads in model_processes), model_processes
    if offset:
        assert len(lowered) >= 2, values  # the instance's worker and ONNX Runtime's pool thread
        assert set(values.values()) == {base, base + offset}, values
    else:
        assert set(values.values()) == {base}, values
    if slice_s(threading.get_native_id()):  # the kernel reports slices (Linux 6.12 and later)
        # With lowered compute threads the loop preempts them at once: its slice is the shortest, not theirs.
        assert (slices[pid] == SHORTEST_SLICE_S) == bool(offset), slices
        assert all(slices[thread] > SHORTEST_SLICE_S for thread in lowered), slices
