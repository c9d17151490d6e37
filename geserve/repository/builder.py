"""Turns a model's config into a servable model: reads and completes the config (refusing what geserve cannot serve
yet), then builds each version's backend instances, warms them up, and builds the instance pool (or ensemble plan),
scheduler, labels, statistics and readiness check."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from geserve import devices
from geserve.backends.base import ModelInstance, ModelSource
from geserve.backends.registry import BackendRegistry
from geserve.config import ModelConfig, fill_defaults, parse_config_json, read_model_config, validate
from geserve.config.ensemble import is_ensemble, step_model_names
from geserve.config.sequence import SequenceSettings, is_sequence_model
from geserve.errors import GeserveError, InvalidArgumentError, NotFoundError, UnsupportedError
from geserve.repository.model import LoadedModel, tensor_specs
from geserve.repository.store import available_versions, select_versions
from geserve.repository.warmup import warm_up
from geserve.scheduling import admission
from geserve.scheduling.admission import Admission, AdmissionSettings
from geserve.scheduling.base import create_scheduler
from geserve.scheduling.ensemble_plan import EnsemblePlan
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.scheduler import EnsembleSetup
from geserve.statistics import LatencyObserver, ModelStatistics

logger = logging.getLogger(__name__)
# Numbers for the loads of models that use the response cache (see _response_cache_generation).
_CACHE_GENERATIONS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class LifecycleOptions:
    auto_complete: bool = True
    default_instance_kind: int = devices.KIND_CPU
    inline_execution_us: int = 0
    # Per-model latency observer for the metrics' summaries / histograms; None when none are configured.
    latency_observer_factory: Callable[[], LatencyObserver] | None = None
    # A server response cache exists (--cache-config): models that enable `response_cache` use it.
    response_cache: bool = False
    # --overload-control: models admission-controlled unless their `overload_control` parameter says otherwise.
    overload_control: bool = False
    # --model-memory-budget: each version's load is measured (repository/memory.py).
    measure_memory: bool = False

    def new_statistics(self) -> ModelStatistics:
        factory = self.latency_observer_factory
        return ModelStatistics(factory() if factory is not None else None)


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """A model's complete, validated config and the versions its version policy selects."""

    config: ModelConfig
    model_dir: Path
    versions: tuple[int, ...]

    @property
    def is_ensemble(self) -> bool:
        return is_ensemble(self.config)

    @property
    def composing(self) -> list[str]:
        """The models an ensemble's steps run on; none for any other model."""
        return step_model_names(self.config) if self.is_ensemble else []


class ModelBuilder:
    """Reads, completes and validates configs, and builds model versions from them; holds no model state."""

    def __init__(self, registry: BackendRegistry, options: LifecycleOptions) -> None:
        self._registry = registry
        self._options = options

    def composing_names(self, model_dir: Path) -> list[str]:
        """The composing models the config on disk names, read without completing it (auto-complete may run
        model code); none when it is not an ensemble or cannot be read (its own load reports why)."""
        try:
            config = read_model_config(model_dir, allow_missing=True)
        except GeserveError:
            return []
        return step_model_names(config) if is_ensemble(config) else []

    def prepare(self, name: str, model_dir: Path, config_json: str | None) -> PreparedModel:
        """The config (from `config_json` when a load request carries one), completed and validated; blocking."""
        if config_json is not None:
            config = parse_config_json(config_json, f"the 'config' parameter of the load request for '{name}'")
        else:
            config = read_model_config(model_dir, allow_missing=self._options.auto_complete)
        if not config.name:
            config.name = name
        self._registry.complete_platform(config, model_dir)
        versions = available_versions(model_dir)
        backend = self._registry.backend_for(config)
        if self._options.auto_complete and versions:
            backend.auto_complete_config(config, ModelSource(model_dir, versions[-1]))
        fill_defaults(config, self._options.default_instance_kind, backend.default_model_filename)
        validate(config, name)
        _refuse_uncacheable(config)  # Triton validates this with the config, before anything else about serving it
        _refuse_unserved(config)
        selected = select_versions(config.version_policy, versions)
        if not selected:
            raise InvalidArgumentError(
                f"at least one version must be available under the version policy of model '{name}' "
                f"(no numeric version folder in {model_dir})"
            )
        return PreparedModel(config, model_dir, tuple(selected))

    async def build(self, prepared: PreparedModel, version: int, steps: Mapping[str, ModelConfig]) -> LoadedModel:
        """One version, ready to serve; `steps` are an ensemble's composing models' configs, by name."""
        config = prepared.config
        _refuse_uncacheable(config)  # again: an ensemble is marked decoupled once its steps are known
        source = ModelSource(prepared.model_dir, version)
        if not source.version_dir.is_dir():
            raise NotFoundError(f"version folder {source.version_dir} not found")
        backend = self._registry.backend_for(config)
        # Read before the instances load: a missing initial state file fails the load at once.
        sequence = (await asyncio.to_thread(SequenceSettings.from_config, config, prepared.model_dir)
                    if is_sequence_model(config) else None)
        instances = await asyncio.to_thread(backend.create_instances, config, source)
        try:
            # Before the version is READY and before any scheduler sees the instances, as Triton warms each instance
            # up before adding it to the model.
            await warm_up(config, prepared.model_dir, version, instances)
        except BaseException:
            await asyncio.to_thread(_finalize, instances)
            raise
        labels = await asyncio.to_thread(_read_labels, config, prepared.model_dir)
        statistics = self._options.new_statistics()
        readiness = None
        pool: InstancePool | None = None
        if is_ensemble(config):  # no instances: the steps run on their own models
            setup = EnsembleSetup(EnsemblePlan.build(config, dict(steps)), self._registry.host, statistics)
            scheduler = create_scheduler(config, None, setup)
        else:
            pool = InstancePool(config.name, instances, statistics, self._options.inline_execution_us)
            scheduler = create_scheduler(config, pool, sequence=sequence)
            readiness = pool.instances_ready if pool.checks_readiness else None
        return LoadedModel(
            name=config.name,
            version=version,
            config=config,
            scheduler=scheduler,
            statistics=statistics,
            inputs=tensor_specs(config.input),
            outputs=tensor_specs(config.output),
            labels=labels,
            input_order=tuple(t.name for t in config.input),
            decoupled=config.model_transaction_policy.decoupled,
            readiness=readiness,
            model_dir=prepared.model_dir,
            response_cache=_response_cache_generation(config, self._options.response_cache),
            admission=(Admission(config.name, AdmissionSettings.from_config(config), statistics, pool)
                       if admission.wanted(config, self._options.overload_control) else None),
        )


def _refuse_unserved(config: ModelConfig) -> None:
    """Configs geserve cannot serve correctly, refused at load rather than answered wrongly with status 200."""
    if is_sequence_model(config) and config.sequence_batching.state and config.model_transaction_policy.decoupled:
        # A decoupled model answers through its response senders, after the batcher saw its execution end: there is
        # no state output to keep for the sequence's next request.
        raise UnsupportedError(
            f"model '{config.name}' keeps implicit state (sequence_batching.state) and is decoupled: geserve reads a "
            f"sequence's state from the response its execution returns, which a decoupled model does not return, "
            f"so it is not loaded"
        )


def _refuse_uncacheable(config: ModelConfig) -> None:
    """Triton's refusals of `response_cache { enable: true }` (its ValidateModelConfig, with its words), whether the
    server has a cache or not: a sequence model's answers depend on its state and a decoupled model's are a stream,
    so neither can be answered from the cache. An ensemble with a decoupled step is itself decoupled."""
    if not config.response_cache.enable:
        return
    if config.WhichOneof("scheduling_choice") == "sequence_batching":
        raise InvalidArgumentError(
            f"Response Cache does not currently support model {config.name} with sequence batching scheduler. "
            f"Please disable the response cache."
        )
    if config.model_transaction_policy.decoupled:
        raise InvalidArgumentError(
            f"Response Cache does not currently support model {config.name} with 'decoupled' transaction policy. "
            f"Please disable the response cache."
        )


def _response_cache_generation(config: ModelConfig, server_cache: bool) -> int:
    """0 unless both switches are on, as Triton requires (the model's `response_cache { enable: true }` and a server
    cache), else a number no other load gets (`LoadedModel.response_cache`). A model that enables it on a server
    without a cache is served uncached, as Triton serves it (no warning there either)."""
    if not config.response_cache.enable:
        return 0
    if not server_cache:
        logger.debug("model '%s' enables response_cache but the server has no cache (--cache-config): not cached",
                     config.name)
        return 0
    return next(_CACHE_GENERATIONS)


def _finalize(instances: Sequence[ModelInstance]) -> None:
    """Release instances that will never serve (their version failed to load after they were created)."""
    for instance in instances:
        try:
            instance.finalize()
        except Exception:
            logger.exception("finalizing instance '%s' of a version that failed to load", instance.name)


def _read_labels(config: ModelConfig, model_dir: Path) -> dict[str, list[str]]:
    labels = {}
    for output in config.output:
        if output.label_filename:
            path = model_dir / output.label_filename
            try:
                labels[output.name] = path.read_text().splitlines()
            except OSError as exc:
                raise InvalidArgumentError(f"failed to read label file {path}: {exc}") from None
    return labels
