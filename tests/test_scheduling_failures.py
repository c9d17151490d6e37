"""How every scheduler reports an instance that raises instead of returning errors (pure asyncio, no server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from geserve.backends.base import Execution, ModelInstance
from geserve.errors import UnavailableError
from geserve.scheduling.direct import DirectScheduler
from geserve.scheduling.dynamic_batcher import BatcherSettings, DynamicBatcher
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.scheduler import Scheduler
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InputTensor


class _Raising(ModelInstance):
    """An instance with a bug: its execute raises a plain Python exception."""

    name = "raising_0"

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        raise RuntimeError("the instance has a bug")


def _request() -> InferenceRequest:
    data = np.zeros((1, 4), np.float32)
    return InferenceRequest("m", "", [InputTensor("x", "FP32", data.shape, data)], id="r")


def _batcher(pool: InstancePool, preserve_ordering: bool) -> DynamicBatcher:
    # preserve_ordering sends every request through the queue; without it a lone request bypasses the queue
    settings = BatcherSettings(8, (8,), 0, preserve_ordering=preserve_ordering)
    return DynamicBatcher("m", settings, pool)


SCHEDULERS: dict[str, Callable[[InstancePool], Scheduler]] = {
    "direct": DirectScheduler,
    "dynamic batcher, queue bypassed": lambda pool: _batcher(pool, False),
    "dynamic batcher, queued": lambda pool: _batcher(pool, True),
}


@pytest.mark.parametrize("inline", [False, True], ids=["worker thread", "inline"])
@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_an_exception_from_an_instance_fails_the_request_as_unavailable(kind: str, inline: bool) -> None:
    async def main() -> None:
        pool = InstancePool("m", [_Raising()], ModelStatistics(), inline_below_us=1_000_000 if inline else 0)
        pool._typical_ns = 1 if inline else 0  # inline runs need a known typical run time
        scheduler = SCHEDULERS[kind](pool)
        try:
            for _ in range(2):  # the instance stays usable after a failure
                with pytest.raises(UnavailableError, match="execution failed: the instance has a bug"):
                    await asyncio.wait_for(scheduler.enqueue(_request()), 5)
        finally:
            await scheduler.stop()

    asyncio.run(main())
