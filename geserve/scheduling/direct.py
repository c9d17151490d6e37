"""The direct scheduler: every request runs alone on the first free instance, no batching."""

from __future__ import annotations

import asyncio
import time

from geserve.errors import GeserveError, UnavailableError
from geserve.scheduling.pool import InstancePool
from geserve.types import InferenceRequest, InferenceResponse


class DirectScheduler:
    def __init__(self, pool: InstancePool) -> None:
        self._pool = pool
        self._inflight = 0
        self._stopping = False
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def inflight_count(self) -> int:
        return self._inflight

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        if self._stopping:
            raise UnavailableError(f"model '{request.model_name}' is unloading")
        self._inflight += 1
        self._drained.clear()
        try:
            (result,) = await self._pool.execute([request], [time.monotonic_ns()])
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._drained.set()
        if isinstance(result, GeserveError):
            raise result
        return result

    async def stop(self) -> None:
        self._stopping = True
        await self._drained.wait()
        await asyncio.to_thread(self._pool.close)
