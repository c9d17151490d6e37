"""What a scheduler is (the Scheduler protocol) and how a kind of scheduler declares itself: which configs it
serves and how it is built from a model's parts. The kinds are registered, in order, in scheduling/base.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from geserve.backends.base import InferenceHost
from geserve.config import ModelConfig
from geserve.config.sequence import SequenceSettings
from geserve.errors import InternalError
from geserve.scheduling.ensemble_plan import EnsemblePlan
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.queue import Pending
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InferenceResponse


class Scheduler(Protocol):
    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        """Run `request` and return its response; raise GeserveError on failure."""
        ...

    def runs_now(self) -> bool:
        """Whether `run_now` may be called: the request would run at once, on the loop, without awaiting."""
        ...

    def run_now(self, request: InferenceRequest) -> InferenceResponse:
        """`enqueue` without awaiting, right after `runs_now` said so (nothing awaited between the two)."""
        ...

    @property
    def inflight_count(self) -> int: ...

    async def stop(self) -> None:
        """Serve or fail what is queued, wait for what is executing, release the instances."""


class Schedules(Protocol):
    """A scheduler that also queues a request without a coroutine (DynamicBatcher): the caller is called back with the
    outcome (InferenceService.submit's queued run step)."""

    def schedule(
        self, request: InferenceRequest, done: Callable[[InferenceResponse | BaseException], None]
    ) -> Pending | None:
        """Queue `request` (raising what `enqueue` raises): `done` gets its response or error; None, having done
        nothing, where `enqueue` must run it."""
        ...

    def withdraw(self, pending: Pending) -> bool:
        """The caller of a scheduled request went away: False when its outcome is known already, else `done` is never
        called and it leaves the queue."""
        ...


class AnswersLater:
    """For a scheduler whose requests always wait (in a queue, for a batch, for their steps): never ready now."""

    def runs_now(self) -> bool:
        return False

    def run_now(self, request: InferenceRequest) -> InferenceResponse:
        raise InternalError(f"the scheduler of model '{request.model_name}' cannot answer without awaiting")


@dataclass(frozen=True, slots=True)
class EnsembleSetup:
    """What an ensemble's scheduler is built from: its plan, the host its steps call, its statistics."""

    plan: EnsemblePlan
    host: InferenceHost
    statistics: ModelStatistics


@dataclass(frozen=True, slots=True)
class SchedulerParts:
    """What a scheduler is built from: the model's config and, by kind, its instance pool or its ensemble setup; a
    sequence model's settings as its builder read them (initial states from the model's folder)."""

    config: ModelConfig
    pool: InstancePool | None = None
    ensemble: EnsembleSetup | None = None
    sequence: SequenceSettings | None = None

    def instance_pool(self) -> InstancePool:
        if self.pool is None:
            raise ValueError(f"model '{self.config.name}' has no instance pool to schedule on")
        return self.pool

    def ensemble_setup(self) -> EnsembleSetup:
        if self.ensemble is None:
            raise ValueError(f"ensemble '{self.config.name}' has no ensemble setup to schedule with")
        return self.ensemble


@dataclass(frozen=True, slots=True)
class SchedulerKind:
    """One kind of scheduler: the configs it serves (the first kind in the registry that serves one wins) and how
    it is built."""

    name: str
    serves: Callable[[ModelConfig], bool]
    build: Callable[[SchedulerParts], Scheduler]
