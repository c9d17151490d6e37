"""The direct scheduler: every request runs alone on the first free instance, no batching.

A caller cancelled while it waits for an instance leaves the pool's wait list (`InstancePool.acquire`): its request
never runs. One cancelled while running finishes on its instance, counted as an execution; its result is dropped.
"""

from __future__ import annotations

import asyncio
import time

from geserve.config import ModelConfig
from geserve.errors import GeserveError
from geserve.scheduling.inflight import InflightTracker
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.scheduler import SchedulerKind, SchedulerParts
from geserve.types import InferenceRequest, InferenceResponse


class DirectScheduler:
    def __init__(self, pool: InstancePool) -> None:
        self._pool = pool
        self._inflight = InflightTracker()

    @property
    def inflight_count(self) -> int:
        return self._inflight.count

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        self._inflight.enter(request.model_name)
        try:
            (result,) = await self._pool.execute([request], [time.monotonic_ns()])
        finally:
            self._inflight.leave()
        if isinstance(result, GeserveError):
            raise result
        return result

    def runs_now(self) -> bool:
        return self._pool.runs_now

    def run_now(self, request: InferenceRequest) -> InferenceResponse:
        self._inflight.enter(request.model_name)
        try:
            (result,) = self._pool.run_now([request])
        finally:
            self._inflight.leave()
        if isinstance(result, GeserveError):
            raise result
        return result

    async def stop(self) -> None:
        await self._inflight.drain()
        await asyncio.to_thread(self._pool.close)


def _serves(config: ModelConfig) -> bool:
    return True  # the fallback: any model that no other kind serves


def _build(parts: SchedulerParts) -> DirectScheduler:
    return DirectScheduler(parts.instance_pool())


SCHEDULER_KIND = SchedulerKind("direct", _serves, _build)
