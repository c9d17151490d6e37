"""Admission control for one model version (`--overload-control`): refuse at arrival, in a few µs, what the model
cannot answer in time, instead of queueing it until its deadline passes.

Three rules, checked in this order against the requests the model holds (its scheduler's `inflight_count`, or the
requests the service took for it and has not answered, `held`, whichever is more):

- an adaptive concurrency limit, in the family of Netflix's gradient limits and Envoy's adaptive concurrency
  filter: every window the limit moves by the gradient between the model's uncontended latency (the least seen
  lately) and its latency now, plus a queue allowance of sqrt(limit); it never falls below what keeps every instance
  fed with full batches, so it cannot cost throughput. While the model is calm (for a second it refused no request
  while holding its limit or more), a request with a deadline may queue up to twice the limit, the queue-time budget
  deciding: a burst the queue absorbs in time is not refused (at half the capacity a Poisson burst filled the
  limit's floor a few times a minute, and those refused would have made their deadlines), while a standing overload
  soon has one refused with the limit reached and is held to the limit itself from then on (queueing to twice it
  under overload, every request on the budget's word, missed 5% of the arrivals at four times the capacity, and
  goodput fell from 0.85 to 0.71 of capacity);
- lower priority levels (Triton's `priority`, 1 highest) get a smaller share of that limit, so they are refused
  first: the lowest gets half (of the limit itself: a burst's allowance goes to the highest level);
- the queue-time budget: a request whose deadline (or, without one, the model's `overload_queue_budget_ms`) falls
  before the time its turn can come and its own execution end is refused now: it would be answered DEADLINE_EXCEEDED
  after holding a place in the queue. A batching model's service time per request depends on how full its batches
  are: a queue of a batch or more runs in full batches, so it is charged the time measured over batches at least
  half full (at low load the batches are small, and their time per request, up to the batch size times more,
  refused bursts the model would have answered in time), and it waits for whole batches, not for each request ahead
  of it (the requests queued in its batch run with it: charging them one after the other kept the queue short of a
  second full batch, and the model ran half-full batches under overload). The batch running is charged what remains
  of it (the instance pool says when it started), and a full batch at the slow tail of the latest ones' wall time;
  while the model is calm, its queue a burst, at the least a full batch took lately, so that only a request that
  could not make it however fast the model ran is refused (at half the capacity the slow tail refused requests that
  the model then answered in time, running without admission control).

Written here rather than taken from a library: no Python library does it for an asyncio server, and the whole
check is a few comparisons per request.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from geserve.config import ModelConfig
from geserve.devices.loop_batching import LOOP_BATCHING
from geserve.errors import OverloadedError
from geserve.scheduling.pool import InstancePool
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest

SHED_REASONS = ("concurrency", "priority", "deadline")
_WINDOW_NS = 100_000_000  # the limit and the service time are updated at most this often
_MIN_WINDOW_SAMPLES = 8
_NOLOAD_WINDOWS = 100  # the uncontended latency is the least of this many windows' least (about 10 s under load)
_TOLERANCE = 2.0  # latency up to this multiple of the uncontended one leaves the limit alone
_SMOOTHING = 0.2
_ROUND_PERCENTILE = 0.9  # of the latest full batches' times, the one a request is admitted on
_MAX_LIMIT = 10_000.0
_BURST_FACTOR = 2.0  # while calm, a request with a deadline may queue up to this multiple of the limit
_CALM_S = 1.0  # a model that refused no request while holding its limit or more for this long is calm
PARAMETER = "overload_control"
QUEUE_BUDGET_PARAMETER = "overload_queue_budget_ms"


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """How one model version is admitted, from its config: the floor of its limit, its priority levels and the
    queue-time budget of a request without a deadline (0: none)."""

    min_limit: int
    priority_levels: int
    default_level: int
    queue_budget_ns: int
    parallelism: int
    batch: int  # the most rows one execution takes (1 without batching)

    @classmethod
    def from_config(cls, config: ModelConfig) -> AdmissionSettings:
        instances = max(1, sum(group.count for group in config.instance_group))
        batching = config.dynamic_batching if config.HasField("dynamic_batching") else None
        budget = config.parameters.get(QUEUE_BUDGET_PARAMETER)
        return cls(
            min_limit=2 * instances * max(1, config.max_batch_size),
            priority_levels=batching.priority_levels if batching is not None else 0,
            default_level=batching.default_priority_level if batching is not None else 0,
            queue_budget_ns=int(float(budget.string_value) * 1e6) if budget is not None else 0,
            parallelism=instances,
            batch=max(1, config.max_batch_size),
        )


def wanted(config: ModelConfig, server_default: bool) -> bool:
    """Whether `config`'s model is admission-controlled: its `overload_control` parameter ("on"/"off"), else the
    server's `--overload-control`."""
    parameter = config.parameters.get(PARAMETER)
    if parameter is None:
        return server_default
    return parameter.string_value.strip().lower() in ("on", "true", "1")


class Admission:
    """One model version's admission: `admit` before a request queues, `observe` each success's latency."""

    def __init__(
        self, name: str, settings: AdmissionSettings, statistics: ModelStatistics, pool: InstancePool | None = None
    ) -> None:
        self._name = name
        self._pool = pool
        self._settings = settings
        self._statistics = statistics
        self.limit = float(2 * settings.min_limit)
        self.shed = dict.fromkeys(SHED_REASONS, 0)
        self._limit_refused_at = -_CALM_S  # when a request was last refused, the limit reached (time.monotonic())
        # Requests of this model the service holds, from the moment `submit` takes them to their end (the scheduler's
        # count sees a request only once its task reaches the scheduler).
        self.held = 0
        self.service_ns = 0.0  # per request, the model's instances together; 0 until measured
        self.full_service_ns = 0.0  # the same over the last window of batches at least half full; 0 until one ran
        self.round_ns = 0.0  # a full batch's wall time on one instance, high percentile of the latest; 0 until seen
        self.fast_round_ns = 0.0  # the least a full batch can take, as the latest batches show (see _measure_rounds)
        self._window_start = time.monotonic_ns()
        self._window_count = 0
        self._window_sum = 0
        self._window_min = 0
        self._window_peak = 0  # the most requests held while this window's answers were given
        self._minima: deque[int] = deque(maxlen=_NOLOAD_WINDOWS)
        self._totals = statistics.execution_totals()
        self._executions = statistics.execution_count

    def admit_ahead(self, deadline: float | None, inflight: int) -> None:
        """Before the request is decoded: refuse it (OverloadedError) by the rules its body cannot change, the limit
        and the caller's `deadline` (a request shed under overload costs no decoding); else nothing."""
        now = time.monotonic()
        calm = self._calm(now)
        # Taken as bounded: its body may bound it (Triton's `timeout`); `admit` holds one nothing bounds to the limit.
        inflight = self._within_limit(inflight, self._limit_for(bounded=True, calm=calm))
        if deadline is not None and self.service_ns:
            wait_ns, own_ns = self._estimate(inflight, calm)
            self._check_budget(inflight, now + wait_ns / 1e9, deadline - own_ns / 1e9)

    def admit(self, request: InferenceRequest, inflight: int) -> None:
        """Refuse `request` (OverloadedError) when the model cannot take it now, with `inflight` requests in its
        scheduler; else nothing."""
        now = time.monotonic()
        calm = self._calm(now)
        inflight = self._within_limit(inflight, self._limit_for(self._bounded(request), calm))
        levels = self._settings.priority_levels
        if levels > 1:
            share = self._share(request.priority, levels)
            if share < 1.0 and inflight >= self.limit * share:  # a lower level's share of the limit itself
                self._refuse("priority", inflight, f"priority {request.priority} is shed at this load")
        if self.service_ns:
            wait_ns, own_ns = self._estimate(inflight, calm)
            self._check_budget(inflight, now + wait_ns / 1e9, self._latest_start(request, own_ns, now))

    def _calm(self, now: float) -> bool:
        """Whether the model is calm at `now`: no request was refused with its limit held for `_CALM_S`."""
        return now - self._limit_refused_at >= _CALM_S

    def _limit_for(self, bounded: bool, calm: bool) -> float:
        """The limit a request is held to: twice the concurrency limit for one the queue-time budget can judge
        (`bounded`) while the model is `calm` (no refusal with the limit reached lately: a queue past it is a burst,
        not a standing overload), else the limit itself."""
        return _BURST_FACTOR * self.limit if bounded and calm else self.limit

    def _within_limit(self, inflight: int, limit: float) -> int:
        """The requests the model holds (its scheduler's `inflight` or the service's `held`, the more); refused when
        they reach `limit`."""
        inflight = max(inflight, self.held)
        if inflight >= limit:
            what = "twice its concurrency limit (a burst's)" if limit > self.limit else "its concurrency limit"
            self._refuse("concurrency", inflight, f"{what} is reached")
        return inflight

    def _bounded(self, request: InferenceRequest) -> bool:
        """Whether the queue-time budget can judge `request`: it has a deadline, a queue timeout or the model's
        budget."""
        return (request.deadline is not None or request.queue_deadline is not None
                or bool(self._settings.queue_budget_ns))

    def _check_budget(self, inflight: int, turn: float, latest: float | None) -> None:
        """Refuse a request whose `turn` (when it can start, behind the `inflight` requests ahead of it) comes after
        the latest start it can have."""
        if latest is not None and turn > latest:
            self._refuse("deadline", inflight, "it cannot be answered before its deadline")

    def _estimate(self, inflight: int, calm: bool) -> tuple[float, float]:
        """How long a request arriving behind `inflight` waits for its turn, and how long its own execution then
        takes. A queue that fills batches runs in rounds (a full batch on every instance): the request waits for the
        rest of the round running and the full rounds queued ahead of it, then runs in its own; the requests queued in
        its round run with it, not before it. A shorter queue waits at most for the batch running and goes in the
        next. A `calm` model's queue is a burst, and its rounds are charged the least they can take: refused are only
        the requests that could not make their deadline however fast the model ran."""
        settings = self._settings
        round_ns = self.round_ns or (self.full_service_ns or self.service_ns) * settings.batch * settings.parallelism
        if calm and self.fast_round_ns:
            round_ns = min(round_ns, self.fast_round_ns)
        if inflight >= settings.batch:
            round_size = settings.batch * settings.parallelism
            rounds_queued = max(0, inflight - round_size) // round_size
            return self._rest_of_running(round_ns, 0.5 * round_ns) + rounds_queued * round_ns, round_ns
        expected = min(inflight * self.service_ns, round_ns)
        return self._rest_of_running(round_ns, expected), min((inflight + 1) * self.service_ns, round_ns)

    def _rest_of_running(self, round_ns: float, expected_ns: float) -> float:
        """How long until an instance is free: what remains of the execution that started first, were it to take
        what a round of its rows takes (`round_ns` a full one); `expected_ns` where the model's executions are not
        seen (no instance pool: an ensemble) or the one running overran. Charging the expected rest (half a round)
        instead admitted, at four times the capacity, requests that arrived just as a round started: they ran and
        missed their deadline (8% of the executions with a deadline of 2.7 rounds)."""
        pool = self._pool
        if pool is None:
            return expected_ns
        started, rows = pool.soonest_running()
        if not started:
            return 0.0
        settings = self._settings
        if 2 * rows >= settings.batch:
            duration = round_ns * rows / settings.batch
        else:  # at most a full round's, though small batches' time per row is higher
            duration = min(rows * self.service_ns * settings.parallelism, round_ns)
        rest = started + duration - time.monotonic_ns()
        return rest if rest > 0 else expected_ns  # overran what it should take: how much longer is not known

    def _latest_start(self, request: InferenceRequest, own_ns: float, now: float) -> float | None:
        """When `request` must start at the latest: by its queue deadline (without one, within the model's queue
        budget from `now`), and its own execution's time before its deadline; None when nothing bounds it."""
        queued = request.queue_deadline
        if queued is None and self._settings.queue_budget_ns:
            queued = now + self._settings.queue_budget_ns / 1e9
        due = request.deadline
        if due is None:
            return queued
        latest = due - own_ns / 1e9
        return latest if queued is None or latest < queued else queued

    def _share(self, priority: int, levels: int) -> float:
        level = priority if 1 <= priority <= levels else (self._settings.default_level or levels)
        return 1.0 - 0.5 * (level - 1) / (levels - 1)

    def _refuse(self, reason: str, inflight: int, why: str) -> None:
        self.shed[reason] += 1
        now = time.monotonic()
        if inflight >= self.limit:  # by any rule: the queue stands past the limit
            self._limit_refused_at = now
        LOOP_BATCHING.refused(now)
        raise OverloadedError(
            f"model '{self._name}' is overloaded: {why} ({inflight} requests held, limit {int(self.limit)})",
            max(1, math.ceil(inflight * self.service_ns / 1e6)),
        )

    def observe(self, latency_ns: int, inflight: int) -> None:
        """A success took `latency_ns` with `inflight` requests still held: a sample for the limit."""
        self._window_count += 1
        self._window_sum += latency_ns
        if not self._window_min or latency_ns < self._window_min:
            self._window_min = latency_ns
        if inflight > self._window_peak:
            self._window_peak = inflight
        now = time.monotonic_ns()
        if now - self._window_start >= _WINDOW_NS and self._window_count >= _MIN_WINDOW_SAMPLES:
            self._update(now)

    def _update(self, now: int) -> None:
        self._minima.append(self._window_min)
        noload = min(self._minima)
        average = self._window_sum / self._window_count
        gradient = max(0.5, min(1.0, _TOLERANCE * noload / average))
        allowance = math.sqrt(self.limit) if self._window_peak >= self.limit / 2 else 0.0  # grow only when used
        target = self.limit * gradient + allowance
        limit = (1 - _SMOOTHING) * self.limit + _SMOOTHING * target
        self.limit = min(_MAX_LIMIT, max(float(self._settings.min_limit), limit))
        self._measure_service()
        self._window_start, self._window_count, self._window_sum = now, 0, 0
        self._window_min = self._window_peak = 0

    def _measure_service(self) -> None:
        """The model's service time per request over the window: its executions' time over the inferences they
        made, shared by its instances; also kept as the full-batch one when its batches were at least half full."""
        totals = self._statistics.execution_totals()
        executions = self._statistics.execution_count  # read beside the totals: off by an execution at worst
        inferences, busy_ns = totals[0] - self._totals[0], totals[1] - self._totals[1]
        ran = executions - self._executions
        self._totals, self._executions = totals, executions
        if inferences > 0:
            self.service_ns = busy_ns / inferences / self._settings.parallelism
            if 2 * inferences >= ran * self._settings.batch:
                self.full_service_ns = self.service_ns
        if self._pool is not None:
            self._measure_rounds(self._pool)

    def _measure_rounds(self, pool: InstancePool) -> None:
        """A full batch's wall time from start to result on one instance, as the slow tail of the latest full batches
        has it (0, the service time's round, while fewer than a window's samples of them ran lately: at low load the
        batches are small, and scaling their time up to a full batch overstated it and refused requests at half the
        capacity). On a shared or virtual machine the same batch takes a fifth longer now and then (measured at four
        times the capacity: p50 16.8 ms, p90 19.7, p99 21.5), and requests admitted on the average missed."""
        batch = self._settings.batch
        runs = sorted(wall for rows, wall in pool.recent_runs if rows >= batch)
        enough = len(runs) >= _MIN_WINDOW_SAMPLES
        self.round_ns = runs[int(_ROUND_PERCENTILE * (len(runs) - 1))] if enough else 0.0
        # The least a full batch can take: the fastest full one, or without one the fastest of the largest (a full
        # batch is no faster: a batch's time does not fall with its rows); 0 while none ran.
        largest = max((rows for rows, _ in pool.recent_runs), default=0)
        self.fast_round_ns = float(runs[0] if runs else pool.fastest_run(largest))
