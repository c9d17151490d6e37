"""The scheduler protocol and the one factory that picks a scheduler from a model's configuration."""

from __future__ import annotations

from typing import Protocol

from geserve.config import ModelConfig
from geserve.scheduling.pool import InstancePool
from geserve.types import InferenceRequest, InferenceResponse


class Scheduler(Protocol):
    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        """Run `request` and return its response; raise GeserveError on failure."""
        ...

    @property
    def inflight_count(self) -> int: ...

    async def stop(self) -> None:
        """Fail what is still queued, wait for what is executing, release the instances."""


def create_scheduler(config: ModelConfig, pool: InstancePool) -> Scheduler:
    # The dynamic batcher and the sequence batcher plug in here, chosen by config.scheduling_choice.
    from geserve.scheduling.direct import DirectScheduler

    return DirectScheduler(pool)
