"""Every rule of the dynamic batcher, in pure asyncio with recording instances (no server, no ONNX)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from geserve.arrivals import ARRIVALS
from geserve.backends.base import Execution, ModelInstance, Results
from geserve.config import parse_config_text
from geserve.errors import GeserveError, InternalError, InvalidArgumentError, UnavailableError
from geserve.scheduling.adaptive import AdaptiveController
from geserve.scheduling.dynamic_batcher import BatcherSettings, DynamicBatcher
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.queue import QueuePolicy
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, OutputTensor


@pytest.fixture(autouse=True)
def open_ended_arrivals(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests time Triton's queue delay to the letter. A server an earlier test started in this process may have
    marked the process's arrivals bounded, which lets batches go early (tests/test_early_dispatch.py covers that)."""
    monkeypatch.setattr(ARRIVALS, "open_ended", ARRIVALS.open_ended + 1)


class RecordingInstance(ModelInstance):
    """Doubles its input; records each batch's request ids and rows; can be held or made to fail."""

    def __init__(self, name: str = "fake_0", delay: float = 0.0) -> None:
        self.name = name
        self.delay = delay
        self.batches: list[list[str]] = []
        self.rows: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        started = time.monotonic_ns()
        self.gate.wait(5)
        self.batches.append([r.id for r in requests])
        self.rows.append(sum(r.batch_size for r in requests))
        if self.delay:
            time.sleep(self.delay)
        if self.fail_next:
            self.fail_next = False
            return Execution.timed([InternalError("instance failed")] * len(requests), started)
        doubled = [OutputTensor("y", "FP32", r.inputs[0].shape, r.inputs[0].data * 2) for r in requests]
        responses: Results = [
            InferenceResponse(r.model_name, "1", [out], r.id) for r, out in zip(requests, doubled, strict=True)
        ]
        return Execution.timed(responses, started)


def request(rid: str, rows: int = 1, width: int = 4, priority: int = 0, timeout_us: int = 0) -> InferenceRequest:
    data = np.full((rows, width), float(len(rid)), dtype=np.float32)
    req = InferenceRequest("m", "", [InputTensor("x", "FP32", data.shape, data)], id=rid, priority=priority,
                           timeout_us=timeout_us)
    req.batch_size = rows
    return req


def settings(**overrides) -> BatcherSettings:
    values = {"max_batch_size": 8, "preferred_batch_sizes": (8,), "max_queue_delay_ns": 0}
    values.update(overrides)
    return BatcherSettings(**values)


def run(test: Callable[..., Awaitable[None]], batcher_settings: BatcherSettings, instances: int = 1,
        delay: float = 0.0) -> list[RecordingInstance]:
    fakes = [RecordingInstance(f"fake_{i}", delay) for i in range(instances)]

    async def main() -> None:
        pool = InstancePool("m", fakes, ModelStatistics())
        batcher = DynamicBatcher("m", batcher_settings, pool)
        try:
            await asyncio.wait_for(test(batcher, fakes), 20)
        finally:
            await batcher.stop()

    asyncio.run(main())
    return fakes


async def hold(fake: RecordingInstance, batcher: DynamicBatcher, rid: str = "hold") -> asyncio.Task:
    """Occupy the instance with one request until `fake.gate` is set again."""
    fake.gate.clear()
    task = asyncio.ensure_future(batcher.enqueue(request(rid)))
    await asyncio.sleep(0.05)
    return task


def test_requests_waiting_for_a_busy_instance_form_one_batch() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        waiting = [asyncio.ensure_future(batcher.enqueue(request(f"r{i}"))) for i in range(5)]
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        responses = await asyncio.gather(held, *waiting)
        assert [r.id for r in responses] == ["hold", "r0", "r1", "r2", "r3", "r4"]
        np.testing.assert_array_equal(responses[1].outputs[0].data, np.full((1, 4), 4.0))

    fakes = run(body, settings())
    assert fakes[0].batches == [["hold"], ["r0", "r1", "r2", "r3", "r4"]]


def test_batch_size_counts_rows_and_never_exceeds_the_limit() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        waiting = [asyncio.ensure_future(batcher.enqueue(request(f"r{i}", rows=3))) for i in range(3)]
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        await asyncio.gather(held, *waiting)

    fakes = run(body, settings())
    assert fakes[0].rows == [1, 6, 3]


def test_only_requests_with_the_same_shapes_are_merged() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        waiting = [asyncio.ensure_future(batcher.enqueue(request(rid, width=w)))
                   for rid, w in (("a", 4), ("b", 5), ("c", 4), ("d", 5))]
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        await asyncio.gather(held, *waiting)

    fakes = run(body, settings())
    assert fakes[0].batches == [["hold"], ["a", "c"], ["b", "d"]]


def test_only_requests_carrying_the_same_inputs_are_merged() -> None:
    """Same shapes, different (optional) inputs: an instance joins inputs by name, so these never share a batch."""

    def carrying(rid: str, *names: str) -> InferenceRequest:
        req = request(rid)
        x = req.inputs[0]
        req.inputs = [x] + [InputTensor(n, "FP32", x.shape, x.data) for n in names]
        return req

    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        waiting = [asyncio.ensure_future(batcher.enqueue(carrying(rid, *names)))
                   for rid, names in (("a", ("a",)), ("b", ("b",)), ("c", ("a",)), ("d", ()), ("e", ("b",)))]
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        await asyncio.gather(held, *waiting)

    fakes = run(body, settings())
    assert fakes[0].batches == [["hold"], ["a", "c"], ["b", "e"], ["d"]]


def test_preferred_size_goes_at_once_and_a_partial_batch_waits_for_the_delay() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        started = time.monotonic()
        await asyncio.gather(*(batcher.enqueue(request(f"p{i}")) for i in range(4)))
        assert time.monotonic() - started < 0.15  # preferred size 4: no waiting for the 300 ms delay
        started = time.monotonic()
        await asyncio.gather(*(batcher.enqueue(request(f"q{i}")) for i in range(3)))
        assert time.monotonic() - started >= 0.29  # 3 rows: not preferred, so it waits out the delay

    fakes = run(body, settings(preferred_batch_sizes=(4, 8), max_queue_delay_ns=300_000_000))
    assert fakes[0].rows == [4, 3]


def test_a_sleeping_batch_goes_once_arrivals_fill_it_to_the_limit() -> None:
    """The batcher waits out the delay of a partial batch without waking for arrivals that cannot fill it; the
    arrival that does (one row at a time, or many rows at once) sends it at once."""

    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        started = time.monotonic()
        first = [asyncio.ensure_future(batcher.enqueue(request(f"a{i}"))) for i in range(2)]
        await asyncio.sleep(0.02)  # the batcher sleeps with 2 of 4 rows
        first += [asyncio.ensure_future(batcher.enqueue(request(f"b{i}"))) for i in range(2)]
        await asyncio.gather(*first)
        assert time.monotonic() - started < 0.15  # filled to the limit: no waiting for the 300 ms delay
        started = time.monotonic()
        second = asyncio.ensure_future(batcher.enqueue(request("c")))
        await asyncio.sleep(0.02)
        await asyncio.gather(second, batcher.enqueue(request("d", rows=3)))
        assert time.monotonic() - started < 0.15
        started = time.monotonic()
        await asyncio.gather(*(batcher.enqueue(request(f"e{i}")) for i in range(3)))
        assert time.monotonic() - started >= 0.29  # 3 of 4 rows: the delay is waited out

    fakes = run(body, settings(max_batch_size=4, preferred_batch_sizes=(4,), max_queue_delay_ns=300_000_000))
    assert fakes[0].rows == [4, 4, 3]


def test_a_request_with_a_timeout_wakes_a_sleeping_batcher() -> None:
    """An arrival with a queue timeout shorter than the batch's delay is rejected when it expires, not when the
    delay ends."""

    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        waiting = asyncio.ensure_future(batcher.enqueue(request("a")))
        await asyncio.sleep(0.02)
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="Request timeout expired"):
            await batcher.enqueue(request("b", width=5, timeout_us=50_000))  # its own shape: never in a's batch
        assert time.monotonic() - started < 0.25
        await waiting

    run(body, settings(max_batch_size=4, preferred_batch_sizes=(4,), max_queue_delay_ns=400_000_000,
                       policies={1: QueuePolicy(allow_timeout_override=True)}))


def test_full_queue_rejects_at_once_with_unavailable() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        queued = [asyncio.ensure_future(batcher.enqueue(request(f"r{i}"))) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(UnavailableError, match="Exceeds maximum queue size"):
            await batcher.enqueue(request("overflow"))
        fakes[0].gate.set()
        await asyncio.gather(held, *queued)

    run(body, settings(policies={1: QueuePolicy(max_queue_size=2)}))


def test_higher_priority_level_is_served_first() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        low = asyncio.ensure_future(batcher.enqueue(request("low", rows=4, priority=2)))
        await asyncio.sleep(0.01)
        high = asyncio.ensure_future(batcher.enqueue(request("high", rows=4, priority=1)))
        default = asyncio.ensure_future(batcher.enqueue(request("default", rows=4)))  # 0 -> level 2
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        await asyncio.gather(held, low, high, default)

    fakes = run(body, settings(max_batch_size=4, preferred_batch_sizes=(4,), priority_levels=2,
                               default_priority_level=2))
    assert fakes[0].batches == [["hold"], ["high"], ["low"], ["default"]]


def test_timeout_reject_fails_only_the_expired_request() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        patient = asyncio.ensure_future(batcher.enqueue(request("patient", timeout_us=10_000_000)))
        hasty = asyncio.ensure_future(batcher.enqueue(request("hasty", timeout_us=20_000)))
        await asyncio.sleep(0.1)
        fakes[0].gate.set()
        with pytest.raises(UnavailableError, match="Request timeout expired"):
            await hasty
        assert (await patient).id == "patient"
        await held

    policy = QueuePolicy(default_timeout_us=60_000_000, allow_timeout_override=True)
    fakes = run(body, settings(policies={1: policy}))
    assert ["hasty"] not in fakes[0].batches


def test_timeout_cannot_be_lengthened_and_is_ignored_without_override() -> None:
    assert QueuePolicy(default_timeout_us=100, allow_timeout_override=True).timeout_us(500) == 100
    assert QueuePolicy(default_timeout_us=100, allow_timeout_override=True).timeout_us(50) == 50
    assert QueuePolicy(default_timeout_us=100, allow_timeout_override=False).timeout_us(50) == 100
    assert QueuePolicy(allow_timeout_override=True).timeout_us(70) == 70


def test_timeout_delay_moves_the_request_behind_timely_ones() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        late = asyncio.ensure_future(batcher.enqueue(request("late", rows=4, timeout_us=10_000)))
        await asyncio.sleep(0.05)
        timely = asyncio.ensure_future(batcher.enqueue(request("timely", rows=4)))
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        await asyncio.gather(held, late, timely)

    policy = QueuePolicy(delay_on_timeout=True, allow_timeout_override=True)
    fakes = run(body, settings(max_batch_size=4, preferred_batch_sizes=(4,), policies={1: policy}))
    assert fakes[0].batches == [["hold"], ["timely"], ["late"]]


def test_preserve_ordering_across_instances() -> None:
    finished: list[str] = []

    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        fakes[0].delay = 0.2  # the first batch runs slowly on instance 0, the second fast on instance 1

        async def one(rid: str) -> None:
            await batcher.enqueue(request(rid, rows=8))
            finished.append(rid)

        first = asyncio.ensure_future(one("first"))
        await asyncio.sleep(0.02)
        await asyncio.gather(first, one("second"))

    run(body, settings(preserve_ordering=True), instances=2)
    assert finished == ["first", "second"]


def test_gears_pad_a_partial_batch_and_slice_the_padding_off() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        responses = await asyncio.gather(*(batcher.enqueue(request(f"g{i}")) for i in range(3)))
        assert [r.outputs[0].shape for r in responses] == [(1, 4)] * 3

    fakes = run(body, settings(gears=(1, 2, 4, 8), preferred_batch_sizes=(8,), max_queue_delay_ns=50_000_000))
    assert fakes[0].rows == [4] and len(fakes[0].batches[0]) == 4  # 3 requests + 1 padding row


def test_a_failing_instance_fails_its_batch_and_the_batcher_goes_on() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        fakes[0].fail_next = True
        results = await asyncio.gather(*(batcher.enqueue(request(f"f{i}")) for i in range(3)),
                                       return_exceptions=True)
        assert all(isinstance(r, GeserveError) for r in results)
        assert (await batcher.enqueue(request("after"))).id == "after"

    run(body, settings(max_queue_delay_ns=20_000_000))


def test_stop_serves_what_is_queued_and_refuses_new_work() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        held = await hold(fakes[0], batcher)
        queued = asyncio.ensure_future(batcher.enqueue(request("queued")))
        await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(batcher.stop())
        await asyncio.sleep(0.01)
        with pytest.raises(UnavailableError, match="unloading"):
            await batcher.enqueue(request("late"))
        fakes[0].gate.set()
        assert (await queued).id == "queued" and (await held).id == "hold"
        await stopping
        assert batcher.inflight_count == 0

    run(body, settings())


def test_batch_larger_than_the_limit_is_invalid() -> None:
    async def body(batcher: DynamicBatcher, fakes: list[RecordingInstance]) -> None:
        with pytest.raises(InvalidArgumentError, match="batch-size must be <= 4"):
            await batcher.enqueue(request("big", rows=5))

    run(body, settings(max_batch_size=4, preferred_batch_sizes=(4,), gears=(1, 2, 4)))


def test_settings_follow_triton_normalization() -> None:
    config = parse_config_text(
        """
        name: "m" max_batch_size: 16
        dynamic_batching {
          max_queue_delay_microseconds: 250 priority_levels: 3 default_priority_level: 2
          default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 900 }
          priority_queue_policy { key: 1 value: { max_queue_size: 5 } }
        }
        parameters { key: "batch_gears" value: { string_value: "1,2,4,8" } }
        """,
        "test",
    )
    batcher_settings = BatcherSettings.from_config(config)
    assert batcher_settings.max_batch_size == 8  # the largest gear
    assert batcher_settings.preferred_batch_sizes == (8,)  # normalized to [max_batch_size] when absent
    assert batcher_settings.max_queue_delay_ns == 250_000
    assert batcher_settings.policies[1] == QueuePolicy(max_queue_size=5)
    assert batcher_settings.policies[2] == QueuePolicy(delay_on_timeout=True, default_timeout_us=900)
    config.parameters["batch_gears"].string_value = "1,32"
    with pytest.raises(InvalidArgumentError, match="batch_gears"):
        BatcherSettings.from_config(config)


def test_adaptive_controller_halves_above_target_and_grows_back_below() -> None:
    controller = AdaptiveController(target_p99_ms=10, max_batch_size=16, max_delay_ns=1_000_000)
    assert (controller.batch_limit, controller.delay_ns) == (16, 0)
    controller.decide(2_000_000, mean_batch=1.0)
    assert controller.delay_ns == 0  # lone requests: waiting would only add latency
    controller.decide(2_000_000, mean_batch=4.0)
    assert controller.delay_ns > 0  # requests share batches: a little waiting fills them
    controller.decide(20_000_000)
    assert controller.delay_ns < 1_000_000
    while controller.delay_ns:
        controller.decide(20_000_000)
    controller.decide(20_000_000)
    assert controller.batch_limit == 8
    for _ in range(3):
        controller.decide(2_000_000)
    assert controller.batch_limit == 16


def test_adaptive_controller_does_not_shrink_batches_under_a_backlog() -> None:
    """Over the target with requests left queued after each batch: latency is queueing, so batches grow."""
    controller = AdaptiveController(target_p99_ms=10, max_batch_size=16, max_delay_ns=1_000_000)
    controller.decide(20_000_000)
    assert controller.batch_limit == 8  # no backlog: the batch execution is what is slow
    controller.decide(20_000_000, mean_batch=8.0, backlog=0.9)
    assert controller.batch_limit == 16 and controller.delay_ns == 0

