"""The registry of scheduler kinds, in the order a model's config is offered to them, and the one factory that
builds a model's scheduler. A new kind declares a SchedulerKind in its own module and gets one line here."""

from __future__ import annotations

from geserve.config import ModelConfig
from geserve.config.sequence import SequenceSettings
from geserve.scheduling import direct, dynamic_batcher, sequence_batcher
from geserve.scheduling import ensemble as ensembles
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.scheduler import EnsembleSetup, Scheduler, SchedulerKind, SchedulerParts

__all__ = ["SCHEDULER_KINDS", "Scheduler", "create_scheduler"]


# First match wins: the kinds that a config's `scheduling_choice` picks, then direct, which serves any model.
SCHEDULER_KINDS: tuple[SchedulerKind, ...] = (
    ensembles.SCHEDULER_KIND,
    sequence_batcher.SCHEDULER_KIND,
    dynamic_batcher.SCHEDULER_KIND,
    direct.SCHEDULER_KIND,
)


def create_scheduler(
    config: ModelConfig,
    pool: InstancePool | None,
    ensemble: EnsembleSetup | None = None,
    sequence: SequenceSettings | None = None,
) -> Scheduler:
    """The scheduler of the first registered kind that serves `config`, built on `pool` (an ensemble: none, and its
    `ensemble` setup instead; a sequence model: its `sequence` settings too)."""
    parts = SchedulerParts(config, pool, ensemble, sequence)
    for kind in SCHEDULER_KINDS:
        if kind.serves(config):
            return kind.build(parts)
    raise ValueError(f"no scheduler kind serves model '{config.name}'")  # direct serves all: never reached
