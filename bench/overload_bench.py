"""Issue 33's targets: goodput under overload, geserve (admission control on and off) against the real Triton.

An open-loop load generator: requests arrive as a Poisson process at a fixed rate, each sent at its arrival time
whether or not earlier ones were answered, each carrying a deadline. perf_analyzer cannot report goodput (answers
within their deadline per second), so the generator is our own: a separate process (forked before anything else
starts) pinned to its own core, asyncio on uvloop, raw HTTP/1.1 keep-alive connections parsed with httptools, the
request bytes made in advance (KServe binary tensor extension: `Inference-Header-Content-Length`).

What one run does:

1. Builds a CPU-bound ONNX model (4 tokens x 256 features through 256->3072->3072->3072->16 MatMul/Relu, a mean
   over the tokens; ~4.5 ms for one request, ~15 ms for a batch of 8 with one intra-op thread) into a temporary
   repository with `max_batch_size: 8`, one CPU instance, `dynamic_batching { max_queue_delay_microseconds: 500
   default_queue_policy { allow_timeout_override: true } }` and ONNX Runtime with one intra-op and one inter-op
   thread. geserve serves it on its GE backend; Triton (2.51, from the nvidia-pytriton wheel, which has no ONNX
   Runtime backend) serves the same file and config through the Python-backend model of tests/support/reference.py
   (the same ONNX Runtime session, one thread: `GESERVE_REF_ORT_THREADS=1`; a batch Triton forms is one session
   call), and a second Triton the same config less its `default_queue_policy` (`triton_nopolicy`: Triton 2.51's
   batcher stalls for its 500 ms idle wait now and then when a queue policy is set; without one it ignores the
   requests' timeouts).
2. Starts the servers pinned to core 0 (their whole process trees) and the generator pinned to core 1; one server is
   driven at a time, the others idle. A server found exited before a cell (a crash) is noted, and a Triton is
   started again; so is a Triton whose cell left requests unanswered (it would go on executing them, which nobody
   waits for, on the core the next cell's server runs on).
3. Measures each server closed-loop: its unloaded p50 (one connection, back to back) and its throughput (32
   connections; geserve on: 16, its concurrency limit's floor, as more clients would be refused and retry at once).
   "Capacity" is geserve's (off); the deadline is 10x geserve's (off) unloaded p50, in whole ms. Both are the same
   for every server. The capacity is measured again before and after each load's cells, and that load's ratios are
   to their mean (the VM's speed drifts: the same closed loop gave 378-490/s within 15 minutes). Each request
   carries the deadline twice: Triton's `timeout` parameter (µs: a queue timeout, for a request that has not
   started) and the gateway header `x-envoy-expected-rq-timeout-ms` (geserve's end-to-end deadline: no success after
   it; Triton ignores it).
4. For each load (0.5x, 1x, 2x, 4x of capacity) drives each server in turn (order rotated per load): a warm-up,
   then `--duration` seconds whose arrivals are counted, then a drain until every request is answered (at most
   5 s). The generator keeps 64 connections open and opens more (up to 1024) when all are busy; a request that
   finds none free waits client-side for the next one, and that wait counts in its latency, which is always
   measured from its scheduled arrival time. A cell waits for the servers not driven to go idle (a Triton goes on
   executing requests its clients gave up on) and for other processes to leave the CPUs, and is measured again if
   those used more than 15% of them meanwhile.

Each answer is classified on the client: a success within its deadline (goodput), a success after it (late), a 503
carrying Retry-After (refused by admission control), "Request timeout expired" / "Deadline Exceeded" (missed: the
server gave up at or after the deadline), any other error, or no answer by the end of the drain. Reported per load
and server: offered rate, goodput, goodput / capacity, p50 / p99 latency of the successes, the counts; and, to
show where time goes, the generator's CPU and send lag (actual send - scheduled arrival), the server's CPU (geserve:
its event-loop thread's part), a health probe's latency (`GET /v2/health/live` every 20 ms: the front door's
stalls) and admission's refusals by reason. Writes bench/results/overload.md (server logs:
bench/results/overload.*.log, git-ignored) and prints PASS/FAIL lines for the targets: at 2x and 4x geserve's
goodput >= 90% of capacity and >= 3x Triton's; no late success from geserve; nothing refused at 0.5x.

Usage: .venv/bin/python bench/overload_bench.py [--quick] [--duration S] [--loads 0.5,1,2,4]
       [--systems geserve_on,geserve_off,triton,triton_nopolicy] [--no-pin] [--output PATH] [--deadline-ms MS]
(a full run, 15 s cells: about 7 minutes on the 2-vCPU machine; --quick, 6 s cells: about 4)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import multiprocessing
import os
import platform
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geserve.tune.machine import machine_ticks, others_share, tree_cpu_s, wait_for_quiet  # noqa: E402
from tests.support import reference  # noqa: E402
from tests.support.server import RunningServer, start_geserve, stop_geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODEL = "overload_mlp"
TOKENS, FEATURES, HIDDEN, HIDDEN_LAYERS, OUTPUTS = 4, 256, 3072, 3, 16
MAX_BATCH = 8
QUEUE_DELAY_US = 500
ORT_THREADS = 1
LOADS = (0.5, 1.0, 2.0, 4.0)
DEADLINE_FACTOR = 10
CAPACITY_CONCURRENCY = 32
ADMITTED_CONCURRENCY = 2 * MAX_BATCH  # geserve_on's closed loop: its concurrency limit's floor (2 x instances x batch)
BUSY_LIMIT = 0.15  # share of the CPUs used by other processes above which a cell waits, or is measured again
QUIET_BUDGET_S = 120.0  # the run's total time for waiting on other processes
IDLE_SERVERS_LIMIT = 0.02  # the servers not driven now (of one core) above which a cell waits before it starts
# over this long: with 0.5 s, a Triton left with a backlog looked idle before a geserve cell during which it then took
# 2.3% of the core (the cell's health probe stalled 13.7 ms). With 2 s it still took 7.2% in one cell of four runs;
# a Triton that left requests unanswered is now replaced after its cell (`_start_again`), and the cells report the
# rest ("idle servers' CPU").
IDLE_SERVERS_WINDOW_S = 2.0
SETTLE_MAX_S = 30.0  # how long a cell waits for them
POOL = 64  # connections opened before a cell starts
MAX_CONNECTIONS = 1024  # the generator opens more when all are busy, up to this many; then requests wait client-side
SERVER_CORE, CLIENT_CORE = 0, 1
SYSTEMS = {
    "geserve_on": "geserve, --overload-control on",
    "geserve_off": "geserve, --overload-control off",
    "triton": "Triton 2.51 (Python backend, same ORT session), the same config",
    "triton_nopolicy": "Triton 2.51, the config less its default_queue_policy (request timeouts ignored)",
}
CLASSES = ("good", "late", "refused", "missed", "error", "unanswered")


@dataclass(frozen=True)
class Mode:
    duration_s: float
    warm_s: float
    p50_s: float  # unloaded p50 measurement
    capacity_s: float  # closed-loop capacity measurement (after a warm-up of a third of it)


FULL = Mode(duration_s=15.0, warm_s=3.0, p50_s=3.0, capacity_s=6.0)
QUICK = Mode(duration_s=6.0, warm_s=2.0, p50_s=2.0, capacity_s=4.0)


# -------------------------------------------------------------------------------------------------- model


DEADLINE_HEADER = "x-envoy-expected-rq-timeout-ms"
POLICY = "default_queue_policy { allow_timeout_override: true }"
CONFIG = f"""name: "{MODEL}"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {TOKENS}, {FEATURES} ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {OUTPUTS} ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{
  max_queue_delay_microseconds: {QUEUE_DELAY_US}
  {POLICY}
}}
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{ORT_THREADS}" }} }}
parameters {{ key: "inter_op_thread_count" value: {{ string_value: "1" }} }}
"""


def build_repository(root: Path) -> Path:
    """The model's repository (ONNX file and config) under `root`: MatMul/Relu layers, compute-bound on the CPU."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    dims = [FEATURES, *[HIDDEN] * HIDDEN_LAYERS, OUTPUTS]
    nodes, weights, previous = [], [], "x"
    for k, (rows, cols) in enumerate(itertools.pairwise(dims)):
        weight = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(rows)).astype(np.float32)
        weights.append(numpy_helper.from_array(weight, f"w{k}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{k}"], [f"m{k}"]))
        previous = f"m{k}"
        if k < len(dims) - 2:
            nodes.append(helper.make_node("Relu", [previous], [f"r{k}"]))
            previous = f"r{k}"
    nodes.append(helper.make_node("ReduceMean", [previous], ["y"], axes=[1], keepdims=0))
    graph = helper.make_graph(
        nodes, MODEL, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TOKENS, FEATURES])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUTPUTS])], weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    repo = root / "geserve_repo"
    (repo / MODEL / "1").mkdir(parents=True)
    onnx.save(model, str(repo / MODEL / "1" / "model.onnx"))
    (repo / MODEL / "config.pbtxt").write_text(CONFIG)
    return repo


def request_bodies(deadline_ms: int, variants: int = 16) -> tuple[bytes, ...]:
    """Whole HTTP requests (head and body) for one-row inferences with different random inputs. `deadline_ms` > 0
    gives each the deadline both ways a server may read it: Triton's `timeout` request parameter (µs; a queue timeout
    for a model with a dynamic batcher: a request that has not started by then is refused) and the gateway header
    `x-envoy-expected-rq-timeout-ms` (the time the caller waits for the answer; Triton ignores it)."""
    import numpy as np

    rng = np.random.default_rng(1)
    header: dict[str, Any] = {
        "inputs": [{"name": "x", "shape": [1, TOKENS, FEATURES], "datatype": "FP32",
                    "parameters": {"binary_data_size": TOKENS * FEATURES * 4}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    if deadline_ms:
        header["parameters"] = {"timeout": deadline_ms * 1000}
    gateway = f"{DEADLINE_HEADER}: {deadline_ms}\r\n" if deadline_ms else ""
    json_bytes = json.dumps(header, separators=(",", ":")).encode()
    requests = []
    for _ in range(variants):
        tensor = rng.standard_normal(TOKENS * FEATURES, dtype=np.float32).tobytes()
        body = json_bytes + tensor
        head = (
            f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/octet-stream\r\n{gateway}"
            f"Inference-Header-Content-Length: {len(json_bytes)}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        requests.append(head + body)
    return tuple(requests)


# ---------------------------------------------------------------------------------------------- generator


PROBE = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
PROBE_PERIOD_S = 0.02
Answer = Callable[[int, bool, bytes], None]  # status (-1: connection lost), Retry-After present, body's start


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time; answers parsed by httptools."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self._error = httptools.HttpParserError
        self.transport: asyncio.Transport | None = None
        self._answer: Answer | None = None
        self._retry_after = False
        self._body = bytearray()
        self.alive = True
        self.fresh = False  # opened during a cell, no request sent on it yet

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes, answer: Answer) -> None:
        self._answer = answer
        assert self.transport is not None
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except self._error:
            self._finish(-1, b"unparsable response")
            if self.transport is not None:
                self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"retry-after":
            self._retry_after = True

    def on_body(self, body: bytes) -> None:
        if len(self._body) < 256:
            self._body += body

    def on_message_complete(self) -> None:
        if not self._parser.should_keep_alive():
            self.alive = False
        self._finish(self._parser.get_status_code(), bytes(self._body[:256]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        self._finish(-1, b"connection lost")

    def _finish(self, status: int, body: bytes) -> None:
        answer, retry_after = self._answer, self._retry_after
        self._answer, self._retry_after = None, False
        self._body.clear()
        if answer is not None:
            answer(status, retry_after, body)

    def close(self) -> None:
        self.alive = False
        if self.transport is not None:
            self.transport.close()


async def _connect(host: str, port: int) -> _Connection:
    _, protocol = await asyncio.get_running_loop().create_connection(_Connection, host, port)
    return protocol


def _settle(future: asyncio.Future[None], *_: object) -> None:
    if not future.done():
        future.set_result(None)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _classify(status: int, retry_after: bool, body: bytes) -> str:
    if status == 200:
        return "good"  # or late: decided by the caller from the latency
    if status == 503 and retry_after:
        return "refused"
    if b"timeout" in body.lower() or b"deadline" in body.lower():
        return "missed"
    return "error"


@dataclass(frozen=True)
class ClosedLoop:
    """`concurrency` connections each sending the next request as soon as the last is answered."""

    host: str
    port: int
    requests: tuple[bytes, ...]
    concurrency: int
    warm_s: float
    duration_s: float

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        connections = await asyncio.gather(*(_connect(self.host, self.port) for _ in range(self.concurrency)))
        start = time.monotonic()
        counted_from, stop = start + self.warm_s, start + self.warm_s + self.duration_s
        latencies: list[float] = []
        failures: dict[str, int] = {}
        done = loop.create_future()
        running = len(connections)

        def send(connection: _Connection, index: int) -> None:
            connection.send(self.requests[index % len(self.requests)], partial(answered, connection, index,
                                                                              time.monotonic()))

        def answered(connection: _Connection, index: int, sent: float, status: int, _retry: bool,
                     body: bytes) -> None:
            nonlocal running
            now = time.monotonic()
            if sent >= counted_from and now <= stop:
                if status == 200:
                    latencies.append(now - sent)
                else:
                    reason = f"{status} {body[:80].decode(errors='replace')}"
                    failures[reason] = failures.get(reason, 0) + 1
            if now < stop and connection.alive:
                send(connection, index + 1)
                return
            running -= 1
            if not running and not done.done():
                done.set_result(None)

        for k, connection in enumerate(connections):
            send(connection, k)
        try:
            await asyncio.wait_for(done, self.warm_s + self.duration_s + 30)
        finally:
            for connection in connections:
                connection.close()
        return {"throughput": len(latencies) / self.duration_s, "p50_ms": _percentile(latencies, 50) * 1e3,
                "p99_ms": _percentile(latencies, 99) * 1e3, "count": len(latencies), "failures": failures}


@dataclass(frozen=True)
class OpenLoop:
    """Poisson arrivals at `rate` per second for `warm_s` + `duration_s`; only the last `duration_s` are counted."""

    host: str
    port: int
    requests: tuple[bytes, ...]
    rate: float
    deadline_s: float
    warm_s: float
    duration_s: float
    seed: int
    pool: int = POOL
    max_connections: int = MAX_CONNECTIONS
    record: bool = False  # also return every request's (scheduled arrival, send lag, latency, outcome)

    def arrivals(self) -> list[float]:
        rng = random.Random(self.seed)
        times: list[float] = []
        t = 0.0
        end = self.warm_s + self.duration_s
        while True:
            t += rng.expovariate(self.rate)
            if t >= end:
                return times
            times.append(t)

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        arrivals = self.arrivals()
        count = len(arrivals)
        idle = list(await asyncio.gather(*(_connect(self.host, self.port) for _ in range(self.pool))))
        connections = list(idle)
        backlog: deque[int] = deque()
        outcome = [""] * count
        latency = [math.nan] * count
        from_send = [math.nan] * count
        lag = [math.nan] * count
        first = [False] * count  # sent as the first request of a connection opened during the cell
        messages: dict[str, int] = {}
        state = {"answered": 0, "opening": 0, "max_backlog": 0}
        pending: set[asyncio.Task[None]] = set()
        all_answered = loop.create_future()
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic() + 0.05

        def launch(index: int, connection: _Connection) -> None:
            now = time.monotonic()
            lag[index] = now - (start + arrivals[index])
            first[index] = connection.fresh
            connection.fresh = False
            connection.send(self.requests[index % len(self.requests)], partial(answered, index, connection, now))

        def answered(index: int, connection: _Connection, sent: float, status: int, retry_after: bool,
                     body: bytes) -> None:
            now = time.monotonic()
            kind = _classify(status, retry_after, body)
            latency[index] = now - (start + arrivals[index])
            from_send[index] = now - sent
            if kind == "good" and latency[index] > self.deadline_s:
                kind = "late"
            if kind == "error":
                message = f"{status} {body[:100].decode(errors='replace')}"
                messages[message] = messages.get(message, 0) + 1
            outcome[index] = kind
            state["answered"] += 1
            if state["answered"] == count and not all_answered.done():
                all_answered.set_result(None)
            if connection.alive:
                release(connection)
            else:
                connections.remove(connection)
                if backlog:
                    grow()

        def release(connection: _Connection) -> None:
            if backlog:
                launch(backlog.popleft(), connection)
            else:
                idle.append(connection)

        def grow() -> None:
            if len(connections) + state["opening"] < self.max_connections:
                state["opening"] += 1
                task = loop.create_task(opened())
                pending.add(task)
                task.add_done_callback(pending.discard)

        async def opened() -> None:  # a task held by `pending` until done
            try:
                connection = await _connect(self.host, self.port)
            except OSError:
                return
            finally:
                state["opening"] -= 1
            connection.fresh = True
            connections.append(connection)
            release(connection)

        def dispatch(index: int) -> None:
            while idle:
                connection = idle.pop()
                if connection.alive:
                    launch(index, connection)
                    return
                connections.remove(connection)  # closed by the server while idle
            backlog.append(index)
            state["max_backlog"] = max(state["max_backlog"], len(backlog))
            grow()

        if not count:
            all_answered.set_result(None)
        probe = await _connect(self.host, self.port)
        probes: list[float] = []
        prober = loop.create_task(self._probe(probe, start + self.warm_s, start + self.warm_s + self.duration_s,
                                              probes))
        next_index = 0
        while next_index < count:
            now = time.monotonic()
            while next_index < count and start + arrivals[next_index] <= now:
                dispatch(next_index)
                next_index += 1
            if next_index < count:
                await asyncio.sleep(max(0.0, start + arrivals[next_index] - time.monotonic()))
        drain_s = max(5.0, 40 * self.deadline_s)
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(all_answered), drain_s)
        wall = time.monotonic() - start
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        await prober
        probe.close()
        most = len(connections)
        for connection in connections:
            connection.close()

        counted = [k for k in range(count) if arrivals[k] >= self.warm_s]
        classes = dict.fromkeys(CLASSES, 0)
        for k in counted:
            classes[outcome[k] or "unanswered"] += 1
        successes = [latency[k] for k in counted if outcome[k] in ("good", "late")]
        refusals = [latency[k] for k in counted if outcome[k] == "refused"]
        lags = [lag[k] for k in counted if not math.isnan(lag[k])]
        late_from_send = sum(1 for k in counted if outcome[k] == "late" and from_send[k] > self.deadline_s)
        lateness = [latency[k] - self.deadline_s for k in counted if outcome[k] == "late"]
        late_first = sum(1 for k in counted if outcome[k] == "late" and first[k])
        cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
        return {
            "offered": len(counted) / self.duration_s,
            "goodput": classes["good"] / self.duration_s,
            "classes": classes,
            "p50_ms": _percentile(successes, 50) * 1e3,
            "p99_ms": _percentile(successes, 99) * 1e3,
            "refusal_p50_ms": _percentile(refusals, 50) * 1e3,
            "lag_p99_ms": _percentile(lags, 99) * 1e3,
            "lag_max_ms": max(lags, default=math.nan) * 1e3,
            "late_from_send": late_from_send,
            "late_max_ms": max(lateness, default=0.0) * 1e3,
            "late_first": late_first,
            "probe_p99_ms": _percentile(probes, 99) * 1e3,
            "probe_max_ms": max(probes, default=math.nan) * 1e3,
            "opened": sum(1 for k in counted if first[k]),
            "max_backlog": state["max_backlog"],
            "connections": most,
            "generator_cpu": cpu / wall if wall > 0 else math.nan,
            "abandoned": outcome.count(""),  # the warm-up's too: all the server may still be working on
            "errors": messages,
            "requests": list(zip(arrivals, lag, latency, outcome, strict=True)) if self.record else [],
        }


    @staticmethod
    async def _probe(connection: _Connection, begin: float, end: float, latencies: list[float]) -> None:
        """A health request every PROBE_PERIOD_S on its own connection from `begin` to `end`: how long the server
        takes to answer what needs no model (its front door's stalls: a garbage collection, a starved thread)."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, begin - time.monotonic()))
        while time.monotonic() < end and connection.alive:
            answered: asyncio.Future[None] = loop.create_future()
            sent = time.monotonic()
            connection.send(PROBE, partial(_settle, answered))
            try:
                await asyncio.wait_for(answered, 10.0)
            except asyncio.TimeoutError:
                return
            latencies.append(time.monotonic() - sent)
            await asyncio.sleep(PROBE_PERIOD_S)


def _generator_main(pipe: Connection, core: int | None) -> None:
    """The generator process: runs the jobs it is sent (ClosedLoop / OpenLoop), one at a time, on uvloop."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    while True:
        job = pipe.recv()
        if job is None:
            loop.close()
            return
        gc.collect()
        gc.disable()  # no collector pauses in a cell: they would show as send lag
        try:
            pipe.send(loop.run_until_complete(job.run()))
        except Exception as exc:  # reported to the parent, which stops the run
            pipe.send({"exception": f"{type(exc).__name__}: {exc}"})
        finally:
            gc.enable()


class Generator:
    """The generator process, pinned to its core: `run(job)` sends a job and returns its summary."""

    def __init__(self, core: int | None) -> None:
        context = multiprocessing.get_context("fork")  # made before any thread or server exists
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_generator_main, args=(child, core), daemon=True)
        self._process.start()
        self.pid = cast(int, self._process.pid)

    def run(self, job: ClosedLoop | OpenLoop) -> dict[str, Any]:
        self._pipe.send(job)
        result: dict[str, Any] = self._pipe.recv()
        if "exception" in result:
            raise RuntimeError(f"generator failed: {result['exception']}")
        return result

    def stop(self) -> None:
        if self._process.is_alive():
            self._pipe.send(None)
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


# ------------------------------------------------------------------------------------------------ servers


@contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """Processes started inside inherit `cores` as their CPU affinity (this process gets its own back after)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass
class Server:
    key: str
    port: int
    pid: int
    metrics_url: str
    stop: Callable[[], None]
    process: subprocess.Popen[bytes]
    restart: Callable[[], Server] | None = None  # a new one on the same repository (a Triton that crashed)

    def alive(self) -> bool:
        return self.process.poll() is None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += _children(current)
    return tree


def stolen_ticks() -> tuple[int, int]:
    """(steal, all) clock ticks of the machine's CPUs since boot (/proc/stat): the time the hypervisor ran something
    else while this VM wanted its CPUs. (0, 0) where /proc/stat does not exist."""
    try:
        values = machine_ticks()
    except OSError:
        return 0, 0
    return values[7], sum(values[:8])


def loop_cpu_s(server: Server) -> float:
    """CPU seconds used so far by geserve's event loop (its main thread); NaN for another server."""
    return thread_cpu_s(server.pid) if server.key.startswith("geserve") else math.nan


def thread_cpu_s(pid: int) -> float:
    """CPU seconds used so far by the main thread of `pid` (geserve's event loop), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def affinity_of(pid: int) -> str:
    lists = set()
    for member in process_tree(pid):
        try:
            lists.add(str(sorted(os.sched_getaffinity(member))))
        except OSError:
            continue
    return ", ".join(sorted(lists))


def _stop_geserve(running: RunningServer) -> None:
    stop_geserve(running)


def start_servers(repo: Path, triton_repos: dict[str, Path], keys: list[str], cores: set[int] | None,
                  stack: ExitStack) -> dict[str, Server]:
    """The servers `keys` names, pinned to `cores`, their models ready; each stopped when `stack` closes. The
    Tritons boot in the background while geserve starts."""
    servers: dict[str, Server] = {}
    tritons: dict[str, reference.BootingTriton] = {}
    with pinned(cores):
        os.environ[reference.ORT_THREADS_ENV] = str(ORT_THREADS)
        for key in keys:
            if key.startswith("triton"):
                tritons[key] = reference.BootingTriton(triton_repos[key], RESULTS, log_name=f"overload.{key}")
                stack.callback(tritons[key].stop)
        for key in keys:
            if key.startswith("geserve"):
                control = "on" if key == "geserve_on" else "off"
                running: RunningServer = start_geserve([repo], RESULTS / f"overload.{key}.log",
                                                      ["--overload-control", control])
                servers[key] = Server(key, running.http_port, running.process.pid, running.metrics_url,
                                      partial(_stop_geserve, running), running.process)
                stack.callback(servers[key].stop)
        for key, triton in tritons.items():
            triton.wait()
            servers[key] = _triton_server(key, triton, partial(_restart_triton, key, triton_repos[key], cores, stack))
    _wait_model(servers)
    return {key: servers[key] for key in keys}


def _triton_server(key: str, triton: reference.BootingTriton, restart: Callable[[], Server]) -> Server:
    return Server(key, triton.http_port, triton.process.pid, triton.metrics_url, triton.stop, triton.process, restart)


def _restart_triton(key: str, repository: Path, cores: set[int] | None, stack: ExitStack) -> Server:
    with pinned(cores):
        triton = reference.BootingTriton(repository, RESULTS, log_name=f"overload.{key}.restart")
        stack.callback(triton.stop)
        triton.wait()
    server = _triton_server(key, triton, partial(_restart_triton, key, repository, cores, stack))
    _wait_model({key: server})
    return server


def triton_repositories(repo: Path, root: Path, keys: list[str]) -> dict[str, Path]:
    """Triton's Python-backend repositories: `triton` from the model's config as it is, `triton_nopolicy` from it
    less its `default_queue_policy` (so Triton ignores the requests' timeouts)."""
    repositories: dict[str, Path] = {}
    if "triton" in keys:
        repositories["triton"] = reference.build_python_backend_repository(repo, root / "triton_repo", [MODEL])
    if "triton_nopolicy" in keys:
        source = root / "nopolicy_source"
        (source / MODEL / "1").mkdir(parents=True)
        (source / MODEL / "1" / "model.onnx").symlink_to(repo / MODEL / "1" / "model.onnx")
        (source / MODEL / "config.pbtxt").write_text(CONFIG.replace(POLICY, ""))
        repositories["triton_nopolicy"] = reference.build_python_backend_repository(
            source, root / "triton_nopolicy_repo", [MODEL])
    return repositories


def _wait_model(servers: dict[str, Server]) -> None:
    for server in servers.values():
        url = f"http://127.0.0.1:{server.port}/v2/models/{MODEL}/ready"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.key}: model {MODEL} not ready")
            time.sleep(0.2)


# Triton's per-model counters, read on both servers: what the model's instance did over a cell.
_EXECUTION_FAMILIES = {"nv_inference_count": "inferences", "nv_inference_exec_count": "executions",
                       "nv_inference_compute_infer_duration_us": "infer_us"}


def model_state(server: Server) -> dict[str, float]:
    """The model's metrics: its inferences, executions and compute time (Triton's families, on every server), and
    geserve's admission: requests shed by reason and the concurrency limit."""
    state: dict[str, float] = {}
    try:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return state
    for line in text.splitlines():
        family = line.split("{", 1)[0]
        if f'model="{MODEL}"' not in line:
            continue
        if family == "ge_overload_shed_total":
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            state[f"shed_{reason}"] = float(line.rsplit(" ", 1)[1])
        elif family == "ge_overload_concurrency_limit":
            state["limit"] = float(line.rsplit(" ", 1)[1])
        elif family in _EXECUTION_FAMILIES:
            state[_EXECUTION_FAMILIES[family]] = float(line.rsplit(" ", 1)[1])
    return state


# ------------------------------------------------------------------------------------------------ the run


@dataclass
class Run:
    mode: Mode
    cores: str
    unloaded: dict[str, dict[str, Any]] = field(default_factory=dict)
    closed: dict[str, dict[str, Any]] = field(default_factory=dict)
    capacity: float = 0.0  # at the start: the offered loads are multiples of it
    capacity_at: dict[float, float] = field(default_factory=dict)  # measured beside each load's cells: its ratios
    capacity_loop_at: dict[float, float] = field(default_factory=dict)  # geserve's loop's share of the core then
    deadline_ms: int = 0
    # --deadline-ms (0: 10x the unloaded p50, the issue's): for A/B runs, as that p50 varies by a tenth from run to
    # run and the deadline's length changes what admission can take
    deadline_given: int = 0
    cells: dict[tuple[float, str], dict[str, Any]] = field(default_factory=dict)
    quiet_left_s: float = QUIET_BUDGET_S
    crashes: list[str] = field(default_factory=list)  # servers found exited (and started again)
    restarts: list[str] = field(default_factory=list)  # Tritons replaced after a cell left them a backlog


def _idle_cpu_s(servers: dict[str, Server], driven: str) -> float:
    """CPU seconds used so far by the servers not driven now (a Triton still working through a backlog its clients
    gave up on shares the driven server's core)."""
    return sum(tree_cpu_s(server.pid) for key, server in servers.items() if key != driven and server.alive())


def _await_idle_servers(servers: dict[str, Server], driven: str) -> None:
    """Wait (at most SETTLE_MAX_S) until the servers not driven now used under IDLE_SERVERS_LIMIT of a core over the
    latest IDLE_SERVERS_WINDOW_S."""
    deadline = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < deadline:
        before = _idle_cpu_s(servers, driven)
        time.sleep(IDLE_SERVERS_WINDOW_S)
        if (_idle_cpu_s(servers, driven) - before) / IDLE_SERVERS_WINDOW_S < IDLE_SERVERS_LIMIT:
            return
    print(f"  (the servers beside {driven} were still busy after {SETTLE_MAX_S:.0f} s)", flush=True)


def _cell(generator: Generator, servers: dict[str, Server], key: str, job: OpenLoop) -> dict[str, Any]:
    """One open-loop cell on `servers[key]`, with the server's CPU, admission's counters, the idle servers' CPU and
    others' CPU share."""
    server = servers[key]
    before = model_state(server)
    cpu_before, loop_before, wall_before = tree_cpu_s(server.pid), loop_cpu_s(server), time.monotonic()
    idle_before = _idle_cpu_s(servers, key)
    steal_before = stolen_ticks()
    with others_share() as others:
        cell = generator.run(job)
    wall = time.monotonic() - wall_before
    steal_after = stolen_ticks()
    cell["steal"] = (steal_after[0] - steal_before[0]) / max(1, steal_after[1] - steal_before[1])
    cell["server_cpu"] = (tree_cpu_s(server.pid) - cpu_before) / wall
    cell["idle_servers"] = (_idle_cpu_s(servers, key) - idle_before) / wall
    cell["loop_cpu"] = (loop_cpu_s(server) - loop_before) / wall
    cell["others"] = others[0] if others else math.nan
    after = model_state(server)
    counted = {name: value - before.get(name, 0.0) if name != "limit" else value for name, value in after.items()}
    executions = counted.pop("executions", 0.0)
    inferences = counted.pop("inferences", 0.0)
    cell["batch_avg"] = inferences / executions if executions else math.nan
    cell["executed_rate"] = inferences / wall
    # Triton counts a batch's compute time once for each request in it: per execution, it is that over the batch.
    cell["instance_busy"] = counted.pop("infer_us", math.nan) / cell["batch_avg"] / 1e6 / wall
    cell["admission"] = counted
    return cell


def _quiet(run: Run) -> None:
    """Wait for other processes to leave the CPUs, out of the run's budget."""
    if run.quiet_left_s <= 0:
        return
    started = time.monotonic()
    wait_for_quiet(BUSY_LIMIT, min(60.0, run.quiet_left_s))
    run.quiet_left_s -= time.monotonic() - started


def measure(generator: Generator, servers: dict[str, Server], run: Run, loads: list[float]) -> None:
    plain = request_bodies(0)
    for server in servers.values():  # warm-up: sessions, arenas, connections
        generator.run(ClosedLoop("127.0.0.1", server.port, plain, 8, 0.0, 1.5))
    for key, server in servers.items():
        _quiet(run)
        run.unloaded[key] = generator.run(ClosedLoop("127.0.0.1", server.port, plain, 1, 0.5, run.mode.p50_s))
        run.closed[key] = _closed_loop(generator, key, server, run, plain)
        concurrency = run.closed[key]["concurrency"]
        print(f"{key}: unloaded p50 {run.unloaded[key]['p50_ms']:.2f} ms, closed-loop "
              f"{run.closed[key]['throughput']:.0f}/s at c={concurrency} "
              f"(p50 {run.closed[key]['p50_ms']:.1f} ms)", flush=True)
    basis = _basis(servers)
    run.capacity = run.closed[basis]["throughput"]
    run.deadline_ms = run.deadline_given or round(DEADLINE_FACTOR * run.unloaded[basis]["p50_ms"])
    print(f"capacity {run.capacity:.0f}/s and deadline {run.deadline_ms} ms ({_deadline_basis(run)}), from {basis}",
          flush=True)
    timed = request_bodies(run.deadline_ms)
    keys = list(servers)
    for step, load in enumerate(loads):
        before, loop_before = _capacity_now(generator, servers, run, plain)
        order = keys[step % len(keys):] + keys[:step % len(keys)]
        for key in order:
            cell = _open_loop_cell(generator, servers, key, run, load, OpenLoop(
                "127.0.0.1", servers[key].port, timed, load * run.capacity, run.deadline_ms / 1e3, run.mode.warm_s,
                run.mode.duration_s, seed=1000 + step))
            if cell:
                run.cells[(load, key)] = cell
        after, loop_after = _capacity_now(generator, servers, run, plain)
        run.capacity_at[load], run.capacity_loop_at[load] = (before + after) / 2, (loop_before + loop_after) / 2
        print(f"capacity beside the {load:g}x cells: {run.capacity_at[load]:.0f}/s "
              f"({_share(run.capacity_loop_at[load])})", flush=True)
        for key in order:
            if (load, key) in run.cells:
                print(row(run, load, key), flush=True)


def _deadline_basis(run: Run) -> str:
    return "given: --deadline-ms" if run.deadline_given else f"{DEADLINE_FACTOR}x geserve's unloaded p50, in whole ms"


def _basis(servers: dict[str, Server]) -> str:
    """The server whose closed-loop throughput is the capacity: geserve without admission control."""
    return "geserve_off" if "geserve_off" in servers else next(iter(servers))


def _closed_loop(generator: Generator, key: str, server: Server, run: Run, plain: tuple[bytes, ...]) -> dict[str, Any]:
    """`server`'s closed-loop throughput run (geserve on at its concurrency limit's floor, the others at 32), with the
    concurrency it ran at."""
    concurrency = ADMITTED_CONCURRENCY if key == "geserve_on" else CAPACITY_CONCURRENCY
    loop_before, wall_before = loop_cpu_s(server), time.monotonic()
    closed = generator.run(ClosedLoop("127.0.0.1", server.port, plain, concurrency, run.mode.capacity_s / 3,
                                      run.mode.capacity_s))
    closed["concurrency"] = concurrency
    # over the warm-up too: the loop's share of the core while the model runs full batches back to back
    closed["loop_cpu"] = (loop_cpu_s(server) - loop_before) / (time.monotonic() - wall_before)
    return closed


def _capacity_now(generator: Generator, servers: dict[str, Server], run: Run,
                  plain: tuple[bytes, ...]) -> tuple[float, float]:
    """The capacity measured again, as at the start: the VM's speed drifts by more than a target's margin over a run
    (the same closed loop gave 378-490/s within 15 minutes), so each load's ratios are to the capacity measured
    before and after its cells."""
    basis = _basis(servers)
    _quiet(run)
    closed = _closed_loop(generator, basis, servers[basis], run, plain)
    return float(closed["throughput"]), float(closed["loop_cpu"])


def _open_loop_cell(generator: Generator, servers: dict[str, Server], key: str, run: Run, load: float,
                    job: OpenLoop) -> dict[str, Any]:
    """One cell, measured again where others used the CPUs meanwhile. A server found exited (a crash) is noted
    and, where it can be (a Triton), started again and the cell measured on the new one."""
    for _ in range(2):
        if not servers[key].alive():
            restart = servers[key].restart
            run.crashes.append(f"{key} had exited by the start of the {load:g}x cell (code "
                               f"{servers[key].process.returncode}){'; started again' if restart else ''}")
            print(f"  {run.crashes[-1]}", flush=True)
            if restart is None:
                return {}
            _start_again(servers, key)
        job = replace(job, port=servers[key].port)
        time.sleep(1.0)
        _await_idle_servers(servers, key)
        _quiet(run)
        try:
            cell = _cell(generator, servers, key, job)
            if cell["others"] > BUSY_LIMIT and run.quiet_left_s > 0:
                print(f"  (others used {cell['others']:.0%} of the CPUs: measured again)", flush=True)
                _quiet(run)
                cell = _cell(generator, servers, key, job)
        except RuntimeError as exc:  # the server could not be reached: it exited
            if servers[key].alive():
                raise
            print(f"  {key}: {exc}", flush=True)
            continue
        _replace_if_backlogged(servers, key, run, f"{load:g}x", cell["abandoned"])
        return cell
    return {}


def _replace_if_backlogged(servers: dict[str, Server], key: str, run: Run, load: str, unanswered: int) -> None:
    """A Triton that left requests unanswered would go on executing them, which nobody waits for, on the core the
    next cell's server runs on: replace it."""
    if unanswered and servers[key].restart is not None:
        run.restarts.append(f"{key} after the {load} cell ({unanswered} requests unanswered)")
        _start_again(servers, key)


def _start_again(servers: dict[str, Server], key: str) -> None:
    """Replace `servers[key]` (a Triton, exited or holding a backlog) by a new one on the same repository."""
    server = servers[key]
    assert server.restart is not None
    with suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)  # its own session: the Python-backend stubs go with it
    server.process.wait()
    servers[key] = server.restart()


# ------------------------------------------------------------------------------------------------ report


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


HEADER = ("| load | server | offered/s | goodput/s | ÷ capacity | p50 ms | p99 ms | late | refused | missed "
          "| other errors | unanswered |")
DIAGNOSTICS_HEADER = ("| load | server | generator CPU | send lag p99 / max ms | connections | client backlog max "
                      "| server CPU | idle servers' CPU | others' CPU / steal | health probe p99 / max ms "
                      "| refusal p50 ms | most late by ms "
                      "| executed/s | batch avg | instance busy | admission (shed by reason, limit at the end) |")


def row(run: Run, load: float, key: str) -> str:
    cell = run.cells[(load, key)]
    classes = cell["classes"]
    return (f"| {load:g}x | {key} | {cell['offered']:.0f} | {cell['goodput']:.0f} | "
            f"{cell['goodput'] / _capacity(run, load):.2f} | {_ms(cell['p50_ms'])} | {_ms(cell['p99_ms'])} | "
            f"{classes['late']} | {classes['refused']} | {classes['missed']} | {classes['error']} | "
            f"{classes['unanswered']} |")


def _capacity(run: Run, load: float) -> float:
    return run.capacity_at.get(load, run.capacity)


def diagnostics_row(load: float, key: str, cell: dict[str, Any]) -> str:
    admission = cell["admission"]
    shed = ", ".join(f"{name[5:]} {int(value)}" for name, value in sorted(admission.items())
                     if name.startswith("shed_") and value)
    limit = f"limit {int(admission['limit'])}" if "limit" in admission else ""
    note = "; ".join(part for part in (shed, limit) if part) or "-"
    loop = "" if math.isnan(cell["loop_cpu"]) else f" (loop {cell['loop_cpu']:.0%})"
    return (f"| {load:g}x | {key} | {cell['generator_cpu']:.0%} | {_ms(cell['lag_p99_ms'])} / "
            f"{_ms(cell['lag_max_ms'])} | {cell['connections']} | {cell['max_backlog']} | "
            f"{cell['server_cpu']:.0%}{loop} | {cell['idle_servers']:.1%} | {cell['others']:.0%} / "
            f"{cell['steal']:.1%} | "
            f"{_ms(cell['probe_p99_ms'])} / "
            f"{_ms(cell['probe_max_ms'])} | {_ms(cell['refusal_p50_ms'])} | "
            f"{cell['late_max_ms']:.1f} | {cell['executed_rate']:.0f} | {cell['batch_avg']:.1f} | "
            f"{cell['instance_busy']:.0%} | {note} |")


def _times(ratio: float) -> str:
    return "unbounded times" if math.isinf(ratio) else f"{ratio:.1f}x"


def targets(run: Run) -> list[str]:
    lines = []
    on, triton = "geserve_on", "triton"
    for load in (2.0, 4.0):
        if (load, on) not in run.cells:
            continue
        goodput, capacity = run.cells[(load, on)]["goodput"], _capacity(run, load)
        ratio = goodput / capacity
        lines.append(f"{'PASS' if ratio >= 0.9 else 'FAIL'}: {load:g}x: geserve's goodput {goodput:.0f}/s is "
                     f"{ratio:.0%} of capacity {capacity:.0f}/s measured beside it (target >= 90%; "
                     f"{goodput / run.capacity:.0%} of the capacity measured at the start, {run.capacity:.0f}/s)")
        if (load, triton) in run.cells:
            theirs = run.cells[(load, triton)]["goodput"]
            times = goodput / theirs if theirs else math.inf
            lines.append(f"{'PASS' if times >= 3 else 'FAIL'}: {load:g}x: geserve's goodput is {_times(times)} "
                         f"Triton's {theirs:.1f}/s (target >= 3x)")
        if (load, "triton_nopolicy") in run.cells:
            theirs = run.cells[(load, "triton_nopolicy")]["goodput"]
            times = goodput / theirs if theirs else math.inf
            lines.append(f"(not a target) {load:g}x: geserve's goodput is {_times(times)} that of Triton without "
                         f"the queue policy, {theirs:.1f}/s")
    lines += [line for key in (on, "geserve_off") if (line := _late_line(run, key, target=key == on))]
    if (0.5, on) in run.cells:
        refused = run.cells[(0.5, on)]["classes"]["refused"]
        lines.append(f"{'PASS' if refused == 0 else 'FAIL'}: 0.5x: geserve refused {refused} (target 0)")
    return lines


def _late_line(run: Run, key: str, target: bool) -> str:
    """The late successes of `key`'s cells; a target for geserve as the docs say to run it under deadlines, admission
    control on (the goodput targets cannot hold without it either: off, the loop's unseen read delays let a few
    successes through)."""
    late = {load: cell["classes"]["late"] for (load, k), cell in run.cells.items() if k == key}
    if not late:
        return ""
    total = sum(late.values())
    detail = ", ".join(f"{load:g}x: {count}" for load, count in late.items())
    from_send = sum(cell["late_from_send"] for (_, k), cell in run.cells.items() if k == key)
    verdict = ("PASS" if total == 0 else "FAIL") if target else "(not a target: admission control off)"
    return (f"{verdict}: {key}: {total} late successes ({detail}; {from_send} of them late counting from the send)"
            f"{' (target 0)' if target else ''}")


def _replacements(run: Run) -> list[str]:
    """The report's lines on the servers found exited and the Tritons replaced during the run."""
    lines = []
    if run.crashes:
        lines += ["", "Servers that exited during the run (their logs: bench/results/overload.<server>*.log): "
                  + "; ".join(run.crashes) + "."]
    if run.restarts:
        lines += ["", "Tritons replaced by a new one after a cell that left requests unanswered (it would have gone "
                  "on executing them beside the next cell's server): " + "; ".join(run.restarts) + "."]
    return lines


def _capacity_note(run: Run, loads: list[float]) -> str:
    beside = ", ".join(f"{load:g}x {run.capacity_at[load]:.0f}/s ({_share(run.capacity_loop_at[load])})"
                       for load in loads if load in run.capacity_at)
    return ("The offered loads are multiples of that capacity; each load's ratios (÷ capacity) are to the capacity "
            "measured again the same way before and after its cells (their mean), since this VM's speed drifts by "
            "more than a target's margin over a run (in brackets: the event loop's share of the core meanwhile, "
            f"where the basis is geserve): {beside}.")


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"loop {value:.0%}"


def report(run: Run, loads: list[float]) -> str:
    keys = sorted({key for _, key in run.cells}, key=list(SYSTEMS).index)
    lines = [
        "# Goodput under overload (issue 33)", "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}); "
        f"`{' '.join(['.venv/bin/python bench/overload_bench.py', *sys.argv[1:]])}`", "",
        f"Model: `{MODEL}`, {TOKENS}x{FEATURES} FP32 in, MatMul/Relu {FEATURES}->"
        f"{'->'.join([str(HIDDEN)] * HIDDEN_LAYERS)}->{OUTPUTS}, mean over tokens; `max_batch_size: {MAX_BATCH}`, "
        f"one CPU instance, `dynamic_batching {{ max_queue_delay_microseconds: {QUEUE_DELAY_US} "
        "default_queue_policy { allow_timeout_override: true } }`, ONNX Runtime with 1 intra-op and 1 inter-op "
        "thread on both servers (geserve: the `intra_op_thread_count` / `inter_op_thread_count` parameters; Triton "
        "2.51: the Python-backend model of tests/support/reference.py, `GESERVE_REF_ORT_THREADS=1`, running each "
        "batch Triton forms as one session call; the wheel has no onnxruntime backend).", "",
        f"CPU sharing: {run.cores}", "",
        f"Open loop: Poisson arrivals, {run.mode.warm_s:g} s warm-up then {run.mode.duration_s:g} s counted per cell, "
        f"a drain until every counted request is answered; servers driven one at a time, the order rotated per load. "
        f"The generator (one process, uvloop, raw HTTP/1.1 keep-alive, binary tensors) keeps {POOL} connections open "
        f"and opens more (up to {MAX_CONNECTIONS}) when all are busy; a request finding none free waits client-side, "
        "and latency is always measured from the scheduled arrival.", "",
        "## Unloaded latency and capacity (closed loop)", "",
        "| server | unloaded p50 ms (c=1) | p99 ms | closed loop: concurrency | throughput /s | p50 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key in keys:
        unloaded, closed = run.unloaded[key], run.closed[key]
        failures = sum(closed["failures"].values())
        note = f" ({failures} refused or failed)" if failures else ""
        lines.append(f"| {key} | {unloaded['p50_ms']:.2f} | {unloaded['p99_ms']:.2f} | {closed['concurrency']} | "
                     f"{closed['throughput']:.0f}{note} | {closed['p50_ms']:.1f} |")
    lines += [
        "",
        f"Capacity = geserve's (off) closed-loop throughput, **{run.capacity:.0f}/s**; every server gets the same "
        f"offered loads (geserve on is driven closed-loop at c={ADMITTED_CONCURRENCY}, its concurrency limit's floor: "
        "more clients than its limit are refused and retry at once). "
        f"Deadline = {_deadline_basis(run)} = **{run.deadline_ms} ms**, sent with "
        f"every request to every server as `\"parameters\": {{\"timeout\": {run.deadline_ms * 1000}}}` (µs: Triton's "
        "queue timeout, honoured by both) and as the header "
        f"`{DEADLINE_HEADER}: {run.deadline_ms}` (a gateway's deadline for the answer: geserve's end-to-end "
        "deadline, which Triton does not read).", "",
        _capacity_note(run, loads), "",
        "## Results", "",
        "goodput = successes within the deadline per second; p50/p99 are over the successes (within the deadline or "
        "not); late = successes after it; refused = 503 with Retry-After; missed = \"Request timeout expired\" (503) "
        "or \"Deadline Exceeded\" (504).", "",
        HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [row(run, load, key) for load in loads for key in keys if (load, key) in run.cells]
    lines += _replacements(run)
    lines += ["", "## Targets", "", *(f"- {line}" for line in targets(run)), "",
              "## Diagnostics", "",
              "generator CPU = the generator process's CPU over the cell (its core: 100%); send lag = actual send - "
              "scheduled arrival; server CPU = the server's process tree (with Triton's Python-backend stub) over "
              "the cell, of one core (geserve: its event-loop thread's part); idle servers' CPU = the servers not "
              "driven in the cell (all on the same core), of one core (a cell waits until they used under "
              f"{IDLE_SERVERS_LIMIT:.0%} of it over {IDLE_SERVERS_WINDOW_S:g} s, at most {SETTLE_MAX_S:.0f} s: "
              "a Triton still executing requests "
              "its clients gave up on); others' CPU = the share of the machine's "
              "CPUs used by processes outside this "
              f"run (a cell waits for it to fall below {BUSY_LIMIT:.0%} and is measured again once above it), steal "
              "= the share of the machine's CPU time the hypervisor gave to other guests while this one wanted it "
              "(`/proc/stat`: a slow spell no process here caused); health "
              f"probe = `GET /v2/health/live` every {PROBE_PERIOD_S * 1000:.0f} ms on a connection of its own during "
              "the counted seconds, answered without the model: how long the server's front door stalls; most late "
              "by = the latest success's lateness (scheduled arrival + deadline to answer); executed = the requests "
              "the model ran per second of the cell (warm-up and drain included: more than the goodput where it ran "
              "requests answered late or not at all); batch avg = the model's "
              "inferences per execution over the cell, instance busy = its compute time per execution "
              "(nv_inference_compute_infer_duration_us over batch avg) over the cell's wall time (both from each "
              "server's Triton metrics).", "",
              DIAGNOSTICS_HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    lines += [diagnostics_row(load, key, run.cells[(load, key)]) for load in loads for key in keys
              if (load, key) in run.cells]
    errors: dict[str, int] = {}
    for cell in run.cells.values():
        for message, count in cell["errors"].items():
            errors[message] = errors.get(message, 0) + count
    if errors:
        lines += ["", "Other errors: " + "; ".join(f"{count}x `{message}`" for message, count in errors.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="shorter cells (6 s counted, 2 s warm-up)")
    parser.add_argument("--duration", type=float, help="seconds counted per cell (default 15; --quick 6)")
    parser.add_argument("--loads", default=",".join(f"{load:g}" for load in LOADS),
                        help="multiples of capacity, comma-separated")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"a subset of {','.join(SYSTEMS)}")
    parser.add_argument("--no-pin", action="store_true", help="leave CPU placement to the kernel")
    parser.add_argument("--output", type=Path, default=RESULTS / "overload.md")
    parser.add_argument("--deadline-ms", type=int, default=0,
                        help="every request's deadline (default: 10x geserve's unloaded p50, the issue's)")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if args.duration:
        mode = Mode(args.duration, mode.warm_s, mode.p50_s, mode.capacity_s)
    loads = [float(value) for value in args.loads.split(",")]
    keys = [key for key in SYSTEMS if key in args.systems.split(",")]
    if any(key.startswith("triton") for key in keys) and (reason := reference.reference_unavailable_reason()):
        raise SystemExit(f"Triton: {reason}")
    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    server_cores = {SERVER_CORE} if pin else None
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp, ExitStack() as stack:
        generator = Generator(CLIENT_CORE if pin else None)
        stack.callback(generator.stop)
        repo = build_repository(Path(tmp))
        servers = start_servers(repo, triton_repositories(repo, Path(tmp), keys), keys, server_cores, stack)
        if pin:
            placed = "; ".join(f"{key} {affinity_of(server.pid)}" for key, server in servers.items())
            cores = (f"servers pinned to core {SERVER_CORE} (whole process trees: {placed}), the generator to core "
                     f"{CLIENT_CORE} ({affinity_of(generator.pid)}); one server driven at a time, the others idle.")
        else:
            cores = "not pinned (--no-pin): servers and generator share the machine's cores."
        print(cores, flush=True)
        run = Run(mode, cores, deadline_given=args.deadline_ms)
        measure(generator, servers, run, loads)
        text = report(run, loads)
    print()
    print(text)
    args.output.write_text(text)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
