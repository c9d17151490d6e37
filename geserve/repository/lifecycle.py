"""Model lifecycle: per-version load and unload, serialized per model, with each version's state and reason."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from geserve import devices
from geserve.backends.base import ModelSource
from geserve.backends.registry import BackendRegistry
from geserve.config import ModelConfig, fill_defaults, parse_config_json, read_model_config, validate
from geserve.config.ensemble import is_ensemble
from geserve.errors import GeserveError, InternalError, InvalidArgumentError, NotFoundError, UnavailableError
from geserve.repository.dependencies import Dependencies
from geserve.repository.model import LoadedModel, ModelState, VersionStatus, tensor_specs
from geserve.repository.store import ModelStore, available_versions, select_versions
from geserve.scheduling.base import create_scheduler
from geserve.scheduling.ensemble import EnsembleSetup
from geserve.scheduling.ensemble_plan import EnsemblePlan
from geserve.scheduling.pool import InstancePool
from geserve.statistics import LatencyObserver, ModelStatistics

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRecord:
    name: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    versions: dict[int, VersionStatus] = field(default_factory=dict)
    error: str = ""  # a failure before any version could be tried (config, files)
    loading: bool = False
    # Highest READY version, kept current so the infer path does one dict lookup.
    latest: LoadedModel | None = None
    load_seconds: float = 0.0

    def refresh_latest(self) -> None:
        ready = [v for v, s in self.versions.items() if s.state is ModelState.READY and s.model]
        self.latest = self.versions[max(ready)].model if ready else None


@dataclass(frozen=True, slots=True)
class LifecycleOptions:
    auto_complete: bool = True
    default_instance_kind: int = devices.KIND_CPU
    inline_execution_us: int = 0
    # Per-model latency observer for the metrics' summaries / histograms; None when none are configured.
    latency_observer_factory: Callable[[], LatencyObserver] | None = None

    def new_statistics(self) -> ModelStatistics:
        factory = self.latency_observer_factory
        return ModelStatistics(factory() if factory is not None else None)


class ModelManager:
    def __init__(self, store: ModelStore, registry: BackendRegistry, options: LifecycleOptions) -> None:
        self._store = store
        self._registry = registry
        self._options = options
        self._records: dict[str, ModelRecord] = {}
        self._dependencies = Dependencies(self, store)

    # ---- the infer path -------------------------------------------------------------------------

    def get(self, name: str, version: str = "") -> LoadedModel:
        record = self._records.get(name)
        if record is None:
            raise NotFoundError(f"Request for unknown model: '{name}' is not found")
        if not version:
            if record.latest is None:
                raise NotFoundError(f"Request for unknown model: '{name}' has no available versions")
            return record.latest
        try:
            number = int(version)
        except ValueError:
            raise InvalidArgumentError(f"failed to parse model version '{version}' for model '{name}'") from None
        status = record.versions.get(number)
        if status is None:
            raise NotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        if status.state is not ModelState.READY or status.model is None:
            raise UnavailableError(
                f"Request for unknown model: '{name}' version {version} is not at ready state"
            )
        return status.model

    # ---- repository operations --------------------------------------------------------------------

    def known_names(self) -> list[str]:
        names = set(self._records)
        with contextlib.suppress(GeserveError):
            names.update(self._store.scan())
        return sorted(names)

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        entries: list[dict[str, str]] = []
        for name in self.known_names():
            record = self._records.get(name)
            if record is None:
                if not ready_only:
                    entries.append({"name": name})
                continue
            if not record.versions:
                if not ready_only:
                    state = ModelState.LOADING if record.loading else ModelState.UNAVAILABLE
                    entry = {"name": name, "state": state.value}
                    if record.error:
                        entry["reason"] = record.error
                    entries.append(entry)
                continue
            for version, status in sorted(record.versions.items()):
                if ready_only and status.state is not ModelState.READY:
                    continue
                entry = {"name": name, "version": str(version), "state": status.state.value}
                if status.reason:
                    entry["reason"] = status.reason
                entries.append(entry)
        return entries

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except GeserveError:
            return False
        return True

    def all_ready(self) -> bool:
        """Strict readiness: every model the server was asked to serve has a ready version."""
        return all(r.latest is not None for r in self._records.values() if r.versions or r.error)

    def models(self) -> list[LoadedModel]:
        loaded = []
        for record in self._records.values():
            for status in record.versions.values():
                if status.model is not None and status.state is ModelState.READY:
                    loaded.append(status.model)
        return loaded

    def record(self, name: str) -> ModelRecord | None:
        return self._records.get(name)

    async def load(self, name: str, config_json: str | None = None) -> None:
        """Load (or reload) a model's versions under its policy; raise naming the reason if any failed."""
        await self._dependencies.track(name, self._load(name, config_json))
        await self._dependencies.after_load(name)

    async def _load(self, name: str, config_json: str | None) -> None:
        model_dir = self._store.find(name)
        if model_dir is None:
            raise InternalError(f"failed to load '{name}', failed to poll from model repository")
        record = self._records.setdefault(name, ModelRecord(name))
        async with record.lock:
            record.loading = True
            started = time.monotonic()
            try:
                failures = await self._load_locked(record, model_dir, config_json)
            finally:
                record.loading = False
                record.load_seconds = time.monotonic() - started
        if failures:
            raise InvalidArgumentError(f"load failed for model '{name}': {'; '.join(failures)}")

    async def _load_locked(self, record: ModelRecord, model_dir: Path, config_json: str | None) -> list[str]:
        previous = {v: s for v, s in record.versions.items() if s.model is not None}
        try:
            config, selected = await asyncio.to_thread(self._prepare, record.name, model_dir, config_json)
            steps = await self._dependencies.resolve(record.name, config) if is_ensemble(config) else {}
        except GeserveError as exc:
            logger.error("model '%s' is unavailable: %s", record.name, exc.message)
            if previous:  # as in Triton, a failed reload leaves the serving versions in place
                return [exc.message]
            record.error = exc.message
            record.versions = {}
            record.refresh_latest()
            return [exc.message]
        record.error = ""
        loaded = {version: await self._load_version(config, model_dir, version, steps) for version in selected}
        failures = [f"version {v}: {s.reason}" for v, s in loaded.items() if s.state is not ModelState.READY]
        for version, status in list(loaded.items()):
            if status.state is not ModelState.READY and version in previous:
                loaded[version] = previous.pop(version)
        # The new versions go live before the old ones stop, so a reload never drops traffic.
        record.versions = loaded
        record.refresh_latest()
        await self._stop(record.name, list(previous.values()))
        for version, status in previous.items():
            record.versions.setdefault(version, status)
        return failures

    def _prepare(self, name: str, model_dir: Path, config_json: str | None) -> tuple[ModelConfig, list[int]]:
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
        selected = select_versions(config.version_policy, versions)
        if not selected:
            raise InvalidArgumentError(
                f"at least one version must be available under the version policy of model '{name}' "
                f"(no numeric version folder in {model_dir})"
            )
        return config, selected

    async def _load_version(
        self, config: ModelConfig, model_dir: Path, version: int, steps: dict[str, ModelConfig]
    ) -> VersionStatus:
        source = ModelSource(model_dir, version)
        if not source.version_dir.is_dir():
            return VersionStatus(ModelState.UNAVAILABLE, f"version folder {source.version_dir} not found")
        try:
            backend = self._registry.backend_for(config)
            instances = await asyncio.to_thread(backend.create_instances, config, source)
            labels = await asyncio.to_thread(_read_labels, config, model_dir)
            statistics = self._options.new_statistics()
            readiness = None
            if is_ensemble(config):  # no instances: the steps run on their own models
                setup = EnsembleSetup(EnsemblePlan.build(config, steps), self._registry.host, statistics)
                scheduler = create_scheduler(config, None, setup)
            else:
                pool = InstancePool(config.name, instances, statistics, self._options.inline_execution_us)
                scheduler = create_scheduler(config, pool)
                readiness = pool.instances_ready if pool.checks_readiness else None
        except GeserveError as exc:
            logger.error("model '%s' version %d is unavailable: %s", config.name, version, exc.message)
            return VersionStatus(ModelState.UNAVAILABLE, exc.message)
        model = LoadedModel(
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
        )
        logger.info("successfully loaded '%s' version %d", config.name, version)
        return VersionStatus(ModelState.READY, "", model)

    async def _stop(self, name: str, statuses: list[VersionStatus]) -> None:
        for status in statuses:
            if status.model is None:
                continue
            status.state = ModelState.UNLOADING
            await status.model.scheduler.stop()
            logger.info("successfully unloaded '%s' version %d", name, status.model.version)
            status.model = None
            status.state, status.reason = ModelState.UNAVAILABLE, "unloaded"

    async def _unload_locked(self, record: ModelRecord) -> None:
        statuses = list(record.versions.values())
        for status in statuses:
            if status.state is ModelState.READY:
                status.state = ModelState.UNLOADING
        record.refresh_latest()
        await self._stop(record.name, statuses)
        record.refresh_latest()

    async def unload(self, name: str) -> None:
        record = self._records.get(name)
        if record is None:
            return  # as in Triton, unloading what is not loaded succeeds
        await self._dependencies.before_unload(name)
        async with record.lock:
            await self._unload_locked(record)

    async def shutdown(self) -> None:
        for record in list(self._records.values()):
            async with record.lock:
                await self._unload_locked(record)


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
