"""One model's versions and their states: loads, swaps and unloads them under the model's own lock, and knows
nothing of other models (the model manager decides which model to load when)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from geserve.config import ModelConfig
from geserve.errors import GeserveError
from geserve.repository import memory
from geserve.repository.builder import ModelBuilder, PreparedModel
from geserve.repository.model import LoadedModel, ModelState, VersionStatus

logger = logging.getLogger(__name__)
_UNUSED_POLL_S = 0.005  # how often an unload looks again for the requests of a version to end


@dataclass(slots=True)
class ModelRecord:
    name: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    versions: dict[int, VersionStatus] = field(default_factory=dict)
    error: str = ""  # a failure before any version could be tried (config, files, composing models)
    # Highest READY version, kept current so the infer path does one dict lookup.
    latest: LoadedModel | None = None
    load_seconds: float = 0.0
    # False once unloaded on purpose (an unload request, its folder gone in poll mode, a composing model unloaded):
    # as in Triton, strict readiness then stops waiting for it. A load wants it again.
    wanted: bool = True

    def refresh_latest(self) -> None:
        ready = [v for v, s in self.versions.items() if s.state is ModelState.READY and s.model]
        self.latest = self.versions[max(ready)].model if ready else None

    def serving(self) -> list[LoadedModel]:
        return [s.model for _, s in sorted(self.versions.items()) if s.model is not None]


class VersionLifecycle:
    """Puts one model's versions in and out of service, under its lock; it never loads another model. With `measure`,
    each version is charged what its build added to this process's memory (repository/memory.py), and the charges
    wait in `measured` for whoever decides on them (repository/budget.py)."""

    def __init__(self, builder: ModelBuilder, measure: bool = False) -> None:
        self._builder = builder
        self._measure = measure
        # model -> version -> (bytes its build made resident, bytes it mapped that are not resident yet), since taken
        self.measured: dict[str, dict[int, tuple[int, int]]] = {}

    async def load(
        self, record: ModelRecord, prepared: PreparedModel, steps: Mapping[str, ModelConfig], started: float
    ) -> list[str]:
        """Build the selected versions and put them in service; the failures, one per version that failed."""
        async with record.lock:
            try:
                previous = {v: s for v, s in record.versions.items() if s.model is not None}
                record.error = ""
                loaded = {v: await self._build(prepared, v, steps) for v in prepared.versions}
                failures = [f"version {v}: {s.reason}" for v, s in loaded.items() if s.state is not ModelState.READY]
                _keep_failed_reloads(prepared, loaded, previous)
                # The new versions go live before the old ones stop, so a reload never drops traffic.
                record.versions = loaded
                record.refresh_latest()
                await _stop(record.name, list(previous.values()))
                for version, status in previous.items():
                    record.versions.setdefault(version, status)
                if any(s.model is None for s in previous.values()):  # versions replaced: their memory goes back
                    await memory.give_back()
                return failures
            finally:
                record.load_seconds = time.monotonic() - started

    async def fail(self, record: ModelRecord, message: str, started: float) -> None:
        """The load failed before any version could be tried."""
        async with record.lock:
            record.load_seconds = time.monotonic() - started
            serving = [s for s in record.versions.values() if s.model is not None]
            if serving:  # as in Triton, a failed reload leaves the serving versions in place
                logger.error("reloading model '%s' failed, the versions loaded before keep serving: %s",
                             record.name, message)
                for status in serving:
                    _kept(status, message)
                return
            logger.error("model '%s' is unavailable: %s", record.name, message)
            record.error = message
            record.versions = {}
            record.refresh_latest()

    async def unload(self, record: ModelRecord) -> None:
        async with record.lock:
            statuses = list(record.versions.values())
            for status in statuses:
                if status.state is ModelState.READY:
                    status.state = ModelState.UNLOADING
            record.refresh_latest()
            await _stop(record.name, statuses)
            record.refresh_latest()

    async def _build(self, prepared: PreparedModel, version: int, steps: Mapping[str, ModelConfig]) -> VersionStatus:
        before, mapped = (await memory.settled_pss(), memory.mapped_files()) if self._measure else (0, {})
        try:
            model = await self._builder.build(prepared, version, steps)
            if self._measure:
                resident = max(await memory.settled_pss() - before, 0)
                lazy = memory.not_yet_resident(mapped, memory.mapped_files())
                model.memory = resident + lazy
                self.measured.setdefault(model.name, {})[version] = (resident, lazy)
        except GeserveError as exc:
            logger.error("model '%s' version %d is unavailable: %s", prepared.config.name, version, exc.message)
            return VersionStatus(ModelState.UNAVAILABLE, exc.message)
        logger.info("successfully loaded '%s' version %d", prepared.config.name, version)
        return VersionStatus(ModelState.READY, "", model)


def _keep_failed_reloads(
    prepared: PreparedModel, loaded: dict[int, VersionStatus], previous: dict[int, VersionStatus]
) -> None:
    """Move from `previous` into `loaded` each version whose reload failed and that still serves."""
    for version, status in list(loaded.items()):
        # As in Triton, a version whose reload failed keeps serving, unless its folder is gone: requests
        # for a removed version fail.
        if (status.state is not ModelState.READY and version in previous
                and (prepared.model_dir / str(version)).is_dir()):
            loaded[version] = _kept(previous.pop(version), status.reason)


def _kept(status: VersionStatus, failure: str) -> VersionStatus:
    """`status` serves on after a reload that failed with `failure`: its index entry says why it is the old one."""
    status.reason = f"reload failed, the version loaded before keeps serving: {failure}"
    return status


async def _stop(name: str, statuses: list[VersionStatus]) -> None:
    for status in statuses:
        if status.model is None:
            continue
        status.state = ModelState.UNLOADING
        await _unused(status.model)
        await status.model.scheduler.stop()
        logger.info("successfully unloaded '%s' version %d", name, status.model.version)
        status.model = None
        status.state, status.reason = ModelState.UNAVAILABLE, "unloaded"


async def _unused(model: LoadedModel) -> None:
    """Wait until no request of `model` is under way: one the service resolved to it just before it went out of
    service (a reload's swap, an eviction's hold) reaches its scheduler after that, and a scheduler that stopped
    meanwhile would refuse it ("is unloading"). Those already in the scheduler count too: it would wait for them."""
    while model.users:
        await asyncio.sleep(_UNUSED_POLL_S)
