"""The scheduler registry: which kind of scheduler a model's config gets (no server, no ONNX)."""

from __future__ import annotations

import asyncio

import pytest

from geserve.backends.base import Execution, ModelInstance
from geserve.config import parse_config_text
from geserve.scheduling.base import SCHEDULER_KINDS, create_scheduler
from geserve.scheduling.direct import DirectScheduler
from geserve.scheduling.dynamic_batcher import DynamicBatcher
from geserve.scheduling.ensemble import EnsembleScheduler
from geserve.scheduling.ensemble_plan import EnsemblePlan
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.scheduler import EnsembleSetup
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest


class _Idle(ModelInstance):
    name = "idle_0"

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        raise AssertionError("nothing runs here")


class _Host:
    loop = None


GEARS = 'parameters { key: "batch_gears" value: { string_value: "1,2,4" } }'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_batch_size: 8", DirectScheduler),
        ("max_batch_size: 8 dynamic_batching {}", DynamicBatcher),
        ("max_batch_size: 0 dynamic_batching {}", DirectScheduler),  # nothing to batch without a batch axis
        (f"max_batch_size: 8 {GEARS}", DynamicBatcher),  # gears need padding, which the batcher does
    ],
)
def test_a_model_with_instances_gets_the_kind_its_config_asks_for(text: str, expected: type) -> None:
    async def main() -> None:
        config = parse_config_text(f'name: "m" {text}', "test")
        scheduler = create_scheduler(config, InstancePool("m", [_Idle()], ModelStatistics()))
        try:
            assert type(scheduler) is expected
        finally:
            await scheduler.stop()

    asyncio.run(main())


def test_an_ensemble_gets_the_ensemble_scheduler_on_its_setup() -> None:
    async def main() -> None:
        config = parse_config_text('name: "e" platform: "ensemble"', "test")
        setup = EnsembleSetup(EnsemblePlan.build(config, {}), _Host(), ModelStatistics())  # type: ignore[arg-type]
        scheduler = create_scheduler(config, None, setup)
        assert isinstance(scheduler, EnsembleScheduler)
        await scheduler.stop()

    asyncio.run(main())


def test_a_kind_missing_its_parts_says_what_is_missing() -> None:
    with pytest.raises(ValueError, match="model 'm' has no instance pool to schedule on"):
        create_scheduler(parse_config_text('name: "m" max_batch_size: 8', "test"), None)
    with pytest.raises(ValueError, match="ensemble 'e' has no ensemble setup"):
        create_scheduler(parse_config_text('name: "e" platform: "ensemble"', "test"), None)


def test_direct_is_the_last_kind_and_serves_every_config() -> None:
    assert [kind.name for kind in SCHEDULER_KINDS][-1] == "direct"
    assert SCHEDULER_KINDS[-1].serves(parse_config_text('name: "m"', "test"))
    assert len({kind.name for kind in SCHEDULER_KINDS}) == len(SCHEDULER_KINDS)
