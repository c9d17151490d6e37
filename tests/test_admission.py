"""Admission control's deadline budget (scheduling/admission.py) on its own, without a server: which request a model
that batches can still answer in time, from its measured service time and the requests it holds."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from geserve.backends.base import Execution, ModelInstance
from geserve.errors import InternalError, OverloadedError
from geserve.scheduling import admission as admission_module
from geserve.scheduling.admission import Admission, AdmissionSettings
from geserve.scheduling.pool import InstancePool
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest

BATCH = 8
PER_ROW_MS = 2.0  # a full batch of 8 runs 16 ms


def admission(instances: int = 1) -> Admission:
    settings = AdmissionSettings(min_limit=1_000, priority_levels=0, default_level=0, queue_budget_ns=0,
                                 parallelism=instances, batch=BATCH)
    gate = Admission("m", settings, ModelStatistics())
    gate.service_ns = gate.full_service_ns = PER_ROW_MS * 1e6 / instances  # the instances together
    return gate


def admitted(gate: Admission, held: int, deadline_ms: float) -> bool:
    request = InferenceRequest("m", "", [])
    request.deadline = time.monotonic() + deadline_ms / 1e3
    try:
        gate.admit(request, held)
    except OverloadedError:
        return False
    return True


@pytest.mark.parametrize("held", [8, 12, 15])
def test_a_request_that_joins_the_next_batch_waits_for_the_running_one_only(held: int) -> None:
    """8 running and up to 7 queued: it runs in the next batch, whatever is queued with it. The running batch is
    charged at half (its expected rest, 8 ms), then its own batch's 16 ms: 24 ms."""
    assert admitted(admission(), held, deadline_ms=25)
    assert not admitted(admission(), held, deadline_ms=23)


@pytest.mark.parametrize("held", [16, 23])
def test_a_request_behind_a_full_queued_batch_waits_for_it_too(held: int) -> None:
    """Half the running batch, the full batch queued ahead, its own: 8 + 16 + 16 ms."""
    assert not admitted(admission(), held, deadline_ms=39)
    assert admitted(admission(), held, deadline_ms=41)


def test_instances_run_their_batches_together() -> None:
    """Two instances take 16 requests a round, each round the time of one batch (16 ms)."""
    assert admitted(admission(instances=2), 31, deadline_ms=25)
    assert not admitted(admission(instances=2), 32, deadline_ms=39)
    assert admitted(admission(instances=2), 32, deadline_ms=41)


def test_an_idle_model_charges_one_requests_time() -> None:
    assert admitted(admission(), 0, deadline_ms=2.5)
    assert not admitted(admission(), 0, deadline_ms=1.5)


class HeldInstance(ModelInstance):
    """Runs a batch once `gate` is set (answers nothing: admission only looks at when it started and its rows)."""

    name = "held_0"

    def __init__(self) -> None:
        self.gate = threading.Event()

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        started = time.monotonic_ns()
        self.gate.wait(5)
        return Execution.timed([InternalError("not run")] * len(requests), started)


def rows(count: int) -> list[InferenceRequest]:
    batch = []
    for _ in range(count):
        request = InferenceRequest("m", "", [])
        request.batch_size = 1
        batch.append(request)
    return batch


def test_the_pool_tells_which_execution_frees_an_instance_first() -> None:
    """While a batch runs, the pool reports when it started and its rows; once it is done (or an instance is free),
    nothing."""
    instance = HeldInstance()

    async def main() -> None:
        pool = InstancePool("m", [instance], ModelStatistics())
        assert pool.soonest_running() == (0, 0)
        worker = await pool.acquire()
        before = time.monotonic_ns()
        running = asyncio.ensure_future(pool.run(worker, rows(8), [before] * 8))
        await asyncio.sleep(0.01)
        started, count = pool.soonest_running()
        assert before <= started <= time.monotonic_ns() and count == 8
        instance.gate.set()
        await running
        assert pool.soonest_running() == (0, 0)
        assert [count for count, _ in pool.recent_runs] == [8]
        pool.close()

    asyncio.run(main())


def pooled(ran_ms_ago: float, running_rows: int = BATCH) -> Admission:
    """An admission that sees its model's one instance running a batch of `running_rows` since `ran_ms_ago`."""
    settings = AdmissionSettings(min_limit=1_000, priority_levels=0, default_level=0, queue_budget_ns=0,
                                 parallelism=1, batch=BATCH)
    pool = InstancePool("m", [HeldInstance()], ModelStatistics())
    worker = pool.take_free()
    worker.running = (time.monotonic_ns() - int(ran_ms_ago * 1e6), running_rows)
    gate = Admission("m", settings, ModelStatistics(), pool)
    gate.service_ns = gate.full_service_ns = PER_ROW_MS * 1e6
    return gate


def test_a_request_arriving_as_a_round_starts_waits_for_all_of_it() -> None:
    """A full batch that just started has 16 ms left, then the request's own batch: 32 ms. Charged at half (24 ms),
    it was admitted with a deadline it then missed."""
    assert not admitted(pooled(ran_ms_ago=0), 12, deadline_ms=27)
    assert admitted(pooled(ran_ms_ago=0), 12, deadline_ms=33)


def test_a_request_arriving_as_a_round_ends_waits_for_little_of_it() -> None:
    """A full batch started 10 ms ago has 6 ms left: the request's own batch ends in 22 ms."""
    assert not admitted(pooled(ran_ms_ago=10), 12, deadline_ms=19)
    assert admitted(pooled(ran_ms_ago=10), 12, deadline_ms=23)


def test_a_batch_that_overran_its_time_is_charged_its_expected_rest() -> None:
    """A batch running for 40 ms, more than a round's 16: how much longer is not known, half a round is charged."""
    assert not admitted(pooled(ran_ms_ago=40), 12, deadline_ms=23)
    assert admitted(pooled(ran_ms_ago=40), 12, deadline_ms=25)


def test_a_small_batch_running_is_charged_its_rows() -> None:
    """A batch of 3 rows that just started takes 6 ms at 2 ms a row, then a batch of the 4 requests held with it,
    8 ms."""
    assert not admitted(pooled(ran_ms_ago=0, running_rows=3), 3, deadline_ms=10)
    assert admitted(pooled(ran_ms_ago=0, running_rows=3), 3, deadline_ms=15)


def test_a_round_is_charged_at_the_slow_tail_of_the_latest_full_batches() -> None:
    """Of the latest full batches, the 90th percentile is a round's time: batches that took 16 ms and now and then 24
    make a round 24 ms; smaller batches are left out (their time per row is higher)."""
    gate = pooled(ran_ms_ago=1)
    pool = gate._pool
    assert pool is not None
    pool.recent_runs.extend([(BATCH, 16_000_000)] * 16 + [(BATCH, 24_000_000)] * 4 + [(4, 12_000_000)] * 20)
    gate._measure_rounds(pool)
    assert gate.round_ns == pytest.approx(24e6)


def test_a_round_is_charged_its_service_time_while_few_full_batches_ran() -> None:
    """At low load the batches are small: the round falls back to the measured service time (2 ms a row: 16 ms)."""
    gate = pooled(ran_ms_ago=1)
    pool = gate._pool
    assert pool is not None
    pool.recent_runs.extend([(BATCH, 30_000_000)] * 7 + [(2, 6_000_000)] * 40)
    gate._measure_rounds(pool)
    assert gate.round_ns == 0.0
    assert admitted(gate, 12, deadline_ms=33)  # 15 ms left of the running batch and its own 16


def test_a_calm_model_charges_a_round_the_least_a_full_batch_took_lately() -> None:
    """Full batches of 16 ms and now and then 24: a calm model's queue is a burst, charged 16 ms a round (15 ms left
    of the batch running, then the request's own: 31 ms); once a request was refused with the limit reached, the
    slow tail's 24 (23 + 24: 47 ms)."""
    gate = pooled(ran_ms_ago=1)
    pool = gate._pool
    assert pool is not None
    pool.recent_runs.extend([(BATCH, 16_000_000)] * 16 + [(BATCH, 24_000_000)] * 4)
    gate._measure_rounds(pool)
    assert gate.fast_round_ns == pytest.approx(16e6)
    assert admitted(gate, 12, deadline_ms=33)
    assert not admitted(gate, 12, deadline_ms=29)
    assert not admitted(gate, int(2 * gate.limit), deadline_ms=10_000)  # refused past the limit: no longer calm
    assert not admitted(gate, 12, deadline_ms=33)
    assert admitted(gate, 12, deadline_ms=49)


@pytest.mark.parametrize(
    ("runs", "least_ms"),
    [
        ([(BATCH, 18), (BATCH, 16), (4, 9), (BATCH, 17)], 16),  # the fastest full batch
        ([(2, 5), (6, 14), (6, 13), (3, 8)], 13),  # none full: the fastest of the largest, a full one is no faster
        ([], 0),
    ],
)
def test_the_least_a_full_batch_takes(runs: list[tuple[int, int]], least_ms: int) -> None:
    gate = pooled(ran_ms_ago=1)
    pool = gate._pool
    assert pool is not None
    pool.recent_runs.extend((rows, ms * 1_000_000) for rows, ms in runs)
    gate._measure_rounds(pool)
    assert gate.fast_round_ns == least_ms * 1e6


def limited(priority_levels: int = 0) -> Admission:
    """A gate whose concurrency limit is 8 (twice its floor of 4), service time unmeasured: the limit alone decides."""
    settings = AdmissionSettings(min_limit=4, priority_levels=priority_levels, default_level=priority_levels,
                                 queue_budget_ns=0, parallelism=1, batch=2)
    return Admission("m", settings, ModelStatistics())


def refusal(gate: Admission, held: int, deadline_s: float | None = None, priority: int = 0) -> str | None:
    """Why `gate` refuses a request arriving with `held` requests held (None: admitted)."""
    request = InferenceRequest("m", "", [], priority=priority)
    if deadline_s is not None:
        request.deadline = time.monotonic() + deadline_s
    try:
        gate.admit(request, held)
    except OverloadedError as exc:
        return "priority" if "priority" in str(exc) else "concurrency" if "concurrency" in str(exc) else "deadline"
    return None


def test_a_calm_model_lets_a_request_with_a_deadline_queue_to_twice_its_limit() -> None:
    """Calm (nothing refused at the limit), a request with a deadline is admitted past the limit of 8, up to 16; one
    without a deadline is held to 8, and once it was refused there the limit holds for all."""
    gate = limited()
    assert gate.limit == 8
    assert refusal(gate, 12, deadline_s=10) is None
    assert refusal(gate, 16, deadline_s=10) == "concurrency"
    calm = limited()
    assert refusal(calm, 8) == "concurrency"
    assert refusal(calm, 8, deadline_s=10) == "concurrency"
    assert refusal(calm, 7, deadline_s=10) is None


def test_the_model_is_calm_again_a_while_after_its_last_refusal_at_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission_module, "_CALM_S", 0.05)
    gate = limited()
    assert refusal(gate, 8) == "concurrency"
    assert refusal(gate, 12, deadline_s=10) == "concurrency"
    time.sleep(0.06)
    assert refusal(gate, 12, deadline_s=10) is None


def test_a_refusal_by_the_budget_with_the_limit_reached_ends_the_calm_too() -> None:
    """A short deadline keeps the queue short of twice the limit: the budget refuses first. A refusal with the limit
    held (whatever the rule) shows a standing queue; one below it does not."""
    gate = limited()
    gate.service_ns = 2e6  # 2 ms a row, a batch of 2 in 4 ms
    assert refusal(gate, 6, deadline_s=0.001) == "deadline"
    assert refusal(gate, 10, deadline_s=10) is None
    assert refusal(gate, 10, deadline_s=0.001) == "deadline"
    assert refusal(gate, 10, deadline_s=10) == "concurrency"


def test_lower_priorities_keep_their_share_of_the_limit_itself_while_calm() -> None:
    """With two levels the lower one is shed from half the limit (4 held), calm or not; the highest gets the burst's
    allowance."""
    gate = limited(priority_levels=2)
    assert refusal(gate, 4, deadline_s=10, priority=2) == "priority"
    assert refusal(gate, 3, deadline_s=10, priority=2) is None
    assert refusal(gate, 12, deadline_s=10, priority=1) is None
