"""The registry of scheduler kinds, in the order a model's config is offered to them, and the one factory that
builds a model's scheduler. A new kind (the sequence batcher is next) declares a SchedulerKind in its own module
and gets one line here."""

from __future__ import annotations

from geserve.config import ModelConfig
from geserve.config.ensemble import is_ensemble
from geserve.scheduling import direct, dynamic_batcher
from geserve.scheduling.ensemble import EnsembleScheduler, EnsembleSetup
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.scheduler import Scheduler, SchedulerKind, SchedulerParts

__all__ = ["SCHEDULER_KINDS", "Scheduler", "create_scheduler"]


def _build_ensemble(parts: SchedulerParts) -> Scheduler:
    setup = parts.ensemble_setup()
    return EnsembleScheduler(setup.plan, setup.host, setup.statistics)


# Declared here only because scheduling/ensemble.py is being rewritten; it belongs there, beside the others.
_ENSEMBLE_KIND = SchedulerKind("ensemble", is_ensemble, _build_ensemble)

# First match wins: the kinds that a config's `scheduling_choice` picks, then direct, which serves any model.
SCHEDULER_KINDS: tuple[SchedulerKind, ...] = (
    _ENSEMBLE_KIND,
    dynamic_batcher.SCHEDULER_KIND,
    direct.SCHEDULER_KIND,
)


def create_scheduler(
    config: ModelConfig, pool: InstancePool | None, ensemble: EnsembleSetup | None = None
) -> Scheduler:
    """The scheduler of the first registered kind that serves `config`, built on `pool` (an ensemble: none, and its
    `ensemble` setup instead)."""
    parts = SchedulerParts(config, pool, ensemble)
    for kind in SCHEDULER_KINDS:
        if kind.serves(config):
            return kind.build(parts)
    raise ValueError(f"no scheduler kind serves model '{config.name}'")  # direct serves all: never reached
