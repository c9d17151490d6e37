"""The direct scheduler: every request runs alone on the first free instance, no batching."""

from __future__ import annotations

import asyncio
import time

from geserve.errors import GeserveError
from geserve.scheduling.inflight import InflightTracker
from geserve.scheduling.pool import InstancePool
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

    async def stop(self) -> None:
        await self._inflight.drain()
        await asyncio.to_thread(self._pool.close)
