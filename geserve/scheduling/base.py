"""The scheduler protocol and the one factory that picks a scheduler from a model's configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from geserve.config import ModelConfig
from geserve.scheduling.pool import InstancePool
from geserve.types import InferenceRequest, InferenceResponse

if TYPE_CHECKING:
    from geserve.scheduling.ensemble import EnsembleSetup


class Scheduler(Protocol):
    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        """Run `request` and return its response; raise GeserveError on failure."""
        ...

    @property
    def inflight_count(self) -> int: ...

    async def stop(self) -> None:
        """Serve or fail what is queued, wait for what is executing, release the instances."""


def create_scheduler(
    config: ModelConfig, pool: InstancePool | None, ensemble: EnsembleSetup | None = None
) -> Scheduler:
    """An ensemble (no pool) gets the ensemble scheduler; `dynamic_batching` (or batch gears, which need padding)
    picks the dynamic batcher; else direct."""
    from geserve.scheduling.direct import DirectScheduler
    from geserve.scheduling.dynamic_batcher import BatcherSettings, DynamicBatcher, parse_gears

    if ensemble is not None:
        from geserve.scheduling.ensemble import EnsembleScheduler

        return EnsembleScheduler(ensemble.plan, ensemble.host, ensemble.statistics)
    if pool is None:
        raise ValueError(f"model '{config.name}' has no instance pool to schedule on")

    batching = config.max_batch_size > 0 and (
        config.WhichOneof("scheduling_choice") == "dynamic_batching" or bool(parse_gears(config))
    )
    if batching:
        return DynamicBatcher(config.name, BatcherSettings.from_config(config), pool)
    return DirectScheduler(pool)
