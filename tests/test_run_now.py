"""Requests answered at once, without awaiting (an inference whose model runs on the loop with a free instance): the
instance pool's hand-over that keeps that possible under load, and the HTTP frontend's `begin` giving the
answers, errors and statistics `respond` gives. Pure asyncio with fake instances, and an in-process server."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from geserve import Server, ServerSettings
from geserve.backends.base import Execution
from geserve.frontends.http.app import HttpFrontend
from geserve.scheduling.direct import DirectScheduler
from geserve.scheduling.pool import InstancePool
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest
from tests.test_dynamic_batcher import RecordingInstance, request


def _inline_pool(fake: RecordingInstance) -> InstancePool:
    fake.inline_allowed = True  # the fake computes and returns, as the GE backend's CPU instances (which opt in)
    pool = InstancePool("m", [fake], ModelStatistics(), inline_below_us=1_000_000)
    pool._typical_ns = 1  # a short model: its batches run on the loop
    return pool


def test_a_released_instance_serves_a_request_at_once_before_the_woken_waiters_in_their_order() -> None:
    """Released, the instance goes back to the free list and the first waiter is woken: a request answered at once
    may use it before that waiter runs (it gives it back at once), and the waiters still run in their order."""
    fake = RecordingInstance()

    async def main() -> None:
        pool = _inline_pool(fake)
        scheduler = DirectScheduler(pool)
        held = pool.take_free()  # as a batch running on the instance's thread holds it
        first = asyncio.ensure_future(scheduler.enqueue(request("first")))
        second = asyncio.ensure_future(scheduler.enqueue(request("second")))
        await asyncio.sleep(0.01)
        assert not scheduler.runs_now()
        pool.release(held)
        assert scheduler.runs_now() and not pool.has_free  # free for `run_now`; not for a queued newcomer
        assert scheduler.run_now(request("now")).id == "now"
        assert [(await first).id, (await second).id] == ["first", "second"]
        await scheduler.stop()

    asyncio.run(main())
    assert fake.batches == [["now"], ["first"], ["second"]]


def test_a_newcomer_does_not_take_the_instance_a_woken_waiter_is_about_to_take() -> None:
    fake = RecordingInstance()

    async def main() -> None:
        pool = _inline_pool(fake)
        held = pool.take_free()
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        pool.release(held)
        newcomer = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.01)
        assert waiter.done() and not newcomer.done()
        pool.release(waiter.result())
        assert await asyncio.wait_for(newcomer, 5) is held

    asyncio.run(main())


def test_a_woken_waiter_cancelled_before_it_runs_passes_the_instance_on() -> None:
    fake = RecordingInstance()

    async def main() -> None:
        pool = _inline_pool(fake)
        scheduler = DirectScheduler(pool)
        held = pool.take_free()
        gone = asyncio.ensure_future(scheduler.enqueue(request("gone")))
        stays = asyncio.ensure_future(scheduler.enqueue(request("stays")))
        await asyncio.sleep(0.01)
        pool.release(held)  # wakes "gone", which is cancelled before it runs
        gone.cancel()
        assert (await asyncio.wait_for(stays, 5)).id == "stays"
        assert gone.cancelled() and pool.has_free
        await scheduler.stop()

    asyncio.run(main())
    assert fake.batches == [["stays"]]


def _body(inputs: list[dict], binary: bytes = b"") -> tuple[bytes, dict[bytes, bytes]]:
    header = json.dumps({"inputs": inputs}).encode()
    headers = {b"content-type": b"application/octet-stream"}
    if binary:
        headers[b"inference-header-content-length"] = str(len(header)).encode()
    return header + binary, headers


def test_begin_answers_as_respond_does(good_repo: Path) -> None:
    """The same requests through `begin` (answered at once, the model running on the loop) and `respond` (awaited):
    the same answers (successes and each kind of fault), each counted once in the model's statistics; anything that
    is not an inference is left to `respond`."""
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    binary = {"parameters": {"binary_data_size": 64}, "shape": [1, 16], "datatype": "INT32"}
    cases = {
        "json": _body([{"name": n, "shape": [1, 16], "datatype": "INT32", "data": data.ravel().tolist()}
                       for n in ("INPUT0", "INPUT1")]),
        "binary": _body([{"name": n, **binary} for n in ("INPUT0", "INPUT1")], data.tobytes() * 2),
        "wrong shape": _body([{"name": n, "shape": [1, 15], "datatype": "INT32", "data": list(range(15))}
                              for n in ("INPUT0", "INPUT1")]),
        "missing input": _body([{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}]),
        "malformed": (b"{not json", {}),
    }

    async def main() -> None:
        server = Server(ServerSettings(model_repositories=[good_repo], allow_http=False, allow_grpc=False,
                                       allow_metrics=False, inline_execution_us=10_000_000))  # however slow the VM
        await server.start()
        frontend = HttpFrontend(server.service, 1 << 20)
        try:
            body, headers = cases["json"]
            path = "/v2/models/simple/infer"
            await frontend.respond("POST", path, headers, body, None, None)  # its first run: typical time known

            def begin(method: str, path: str, headers: dict[bytes, bytes], body: bytes) -> Any:
                return frontend.begin(method, path, headers, body, None, None, lambda answer: None)

            assert begin("GET", "/v2/models/simple", {}, b"") is None
            assert begin("POST", "/v2/models/nope/infer", headers, body)[0] == 404
            assert begin("POST", "/v2/models/simple/stats", headers, body) is None
            model = server.service._manager.get("simple")
            for name, (body, headers) in cases.items():
                for version_path in (path, "/v2/models/simple/versions/1/infer"):
                    before = model.statistics.inference_count
                    inline = server.service.paths["inline"]
                    now = begin("POST", version_path, headers, body)
                    later = await frontend.respond("POST", version_path, headers, body, None, None)
                    assert isinstance(now, tuple), name
                    assert now[:4] == later[:4], name
                    assert server.service.paths["inline"] - inline == (2 if now[0] == 200 else 0), name
                    assert model.statistics.inference_count - before == (2 if now[0] == 200 else 0), name
            body, headers = cases["binary"]
            answer = begin("POST", path, headers, body)
            assert answer is not None and answer[0] == 200
            assert json.loads(answer[1])["outputs"][0]["data"] == (2 * data).ravel().tolist()
        finally:
            await server.stop()

    asyncio.run(main())


def test_an_instance_that_does_not_opt_in_never_runs_on_the_loop() -> None:
    """However short its runs look (CPU time cannot see a wait), an instance runs on the loop only if it says so."""
    fake = RecordingInstance()

    async def main() -> None:
        pool = InstancePool("m", [fake], ModelStatistics(), inline_below_us=1_000_000)
        pool._typical_ns = 1
        scheduler = DirectScheduler(pool)
        assert not pool.runs_now and not scheduler.runs_now()
        assert (await scheduler.enqueue(request("queued"))).id == "queued"  # served on the instance's thread
        assert fake.batches == [["queued"]]
        await scheduler.stop()

    asyncio.run(main())


class _BusyInstance(RecordingInstance):
    """Burns `cpu_s` of CPU per batch (a busy loop: the pool judges runs by the thread's CPU time)."""

    inline_allowed = True

    def __init__(self, cpu_s: float) -> None:
        super().__init__()
        self.cpu_s = cpu_s

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        started = time.monotonic_ns()
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return Execution.timed(super().execute(requests).results, started)


def test_a_model_that_turns_slow_on_the_loop_moves_to_its_thread_within_a_few_runs() -> None:
    """Inline runs are timed one in eight (a thread's CPU time is a system call), but after a run longer than the
    inline limit the next is timed too: a model whose runs grew to 3 ms leaves the loop (1 ms limit) within 16 runs,
    where one sample in eight would have taken about 40."""
    slow = _BusyInstance(0.003)

    async def main() -> None:
        pool = InstancePool("m", [slow], ModelStatistics(), inline_below_us=1000)
        pool._typical_ns = 600_000  # it used to take 0.6 ms
        scheduler = DirectScheduler(pool)
        runs = 0
        while scheduler.runs_now() and runs < 16:
            scheduler.run_now(request(f"r{runs}"))
            runs += 1
        assert not pool.runs_now, f"still on the loop after {runs} runs ({pool._typical_ns / 1e3:.0f} µs typical)"
        assert (await scheduler.enqueue(request("later"))).id == "later"  # served on its thread now
        await scheduler.stop()

    asyncio.run(main())
